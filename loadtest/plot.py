"""The Orca paper's figure: median normalized latency (ms/token) against throughput (req/s),
one curve per scheduling policy, with each policy's capacity at a latency target marked."""

from __future__ import annotations

from loadtest.report import Capacity, capacity_ratio, orca_counterpart

COLORS = {"orca": "tab:blue", "request-level": "tab:orange"}
VARIANT_COLORS = {"orca": ("tab:cyan", "navy", "tab:purple"), "request-level": ("tab:red", "tab:brown", "gold")}
OTHER_COLORS = ("tab:green", "tab:purple", "tab:pink", "tab:gray", "tab:olive")


def plot_curves(curves: dict[str, list[tuple[float, float]]], path: str, *, target_ms: float | None,
                capacities: dict[str, Capacity], title: str, subtitle: str = "",
                rate_labels: dict[str, list[str]] | None = None, policies: dict[str, str] | None = None) -> None:
    """`curves` maps a policy to its (throughput, median normalized latency) points in rate order;
    `rate_labels` the offered rate of each point, written small beside it; `policies` the policy
    of each curve whose name is not its policy (a variant: dashed, in a shade of the policy's colour).
    A star on the target line marks each capacity the sweep brackets (dotted line down to its
    throughput); a policy that never crossed the target gets no star and a '>=' in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 5.6), dpi=150)
    spare = iter(OTHER_COLORS)
    variants = {policy: iter(colors) for policy, colors in VARIANT_COLORS.items()}
    xs = [x for points in curves.values() for x, _ in points if x > 0]
    ys = [y for points in curves.values() for _, y in points if y > 0]
    for policy, points in curves.items():
        base = (policies or {}).get(policy, policy)
        variant = base != policy
        color = (next(variants.get(base, spare), None) if variant else COLORS.get(policy)) or next(spare, "black")
        ax.plot([p[0] for p in points], [p[1] for p in points], "o--" if variant else "o-", color=color, lw=2, ms=5,
                label=_label(policy, base, capacities))
        for (x, y), text in zip(points, (rate_labels or {}).get(policy, [])):
            ax.annotate(text, (x, y), xytext=(4, -10), textcoords="offset points", fontsize=7, color=color, alpha=0.8)
        cap = capacities.get(policy)
        if target_ms is not None and cap is not None and cap.kind == "interpolated":
            ax.axvline(cap.req_s, color=color, ls=":", lw=1.2)
            ax.plot([cap.req_s], [target_ms], marker="*", ms=15, color=color, mec="black", mew=0.6, zorder=5)
    if target_ms is not None:
        ax.axhline(target_ms, color="0.35", ls="--", lw=1.2)
        ax.annotate(f"latency target {target_ms:g} ms/token", xy=(0.01, target_ms), xycoords=("axes fraction", "data"),
                    xytext=(0, 4), textcoords="offset points", fontsize=9, color="0.25")
    if ys and max(ys) / min(ys) > 20:
        ax.set_yscale("log")
    if xs and max(xs) / min(xs) > 30:
        ax.set_xscale("log")
    else:
        ax.set_xlim(left=0)
    ax.set_xlabel("throughput (requests/s)" + ("; small numbers: offered rate, req/s" if rate_labels else ""))
    ax.set_ylabel("median normalized latency (ms/token)")
    ax.grid(True, which="both", alpha=0.3)
    legend_title = "policy (capacity at the target; orca's multiple of it)" if "orca" in policies_of(curves, policies) \
        else "policy (capacity at the target)"
    ax.legend(loc="best", fontsize=9, title=legend_title, title_fontsize=9)
    fig.suptitle(title, fontsize=12, fontweight="bold")
    ax.set_title(subtitle, fontsize=9, color="0.2")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _label(label: str, policy: str, capacities: dict[str, Capacity]) -> str:
    cap = capacities.get(label)
    if cap is None:
        return label
    if cap.kind == "below-range":
        return f"{label} (over the target at every rate)"
    text = f"{'>= ' if cap.kind == 'lower-bound' else ''}{cap.req_s:.3g} req/s"
    orca = orca_counterpart(label, policy, capacities)
    if orca is not None:
        ratio, bound = capacity_ratio(capacities[orca], cap)
        text += f"; {orca} {'' if bound == '=' else bound + ' ' if bound != '?' else '~'}{ratio:.3g}x"
    return f"{label} ({text})"


def policies_of(curves: dict, policies: dict[str, str] | None) -> set[str]:
    return {(policies or {}).get(label, label) for label in curves}
