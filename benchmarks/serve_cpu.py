"""CPU seconds per streamed token, per process of a running `orca serve`, under `orca bench` load.

Reads every process under the `orca serve` process (Ray's proxy and gateway replica, the worker
and engine master actors, the tokenizer, nats-server, ...) from /proc before and after each
`orca bench` run, and divides each one's CPU time by the tokens that run streamed. An `inprocess` run measures
the engine alone (`orca bench --transport inprocess`: no NATS, no Ray), its CPU counted as the
worker's; `client` is the CPU of `orca bench` itself:

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 orca serve --model DIR --port 8000 &
    python benchmarks/serve_cpu.py --serve-pid $! --base-url http://127.0.0.1:8000 \
        --nats-url nats://127.0.0.1:4222 --runs http nats inprocess --model DIR -- --num-prompts 128 \
        --dataset random --random-input-len 16:256 --random-output-len 8:256

Arguments after `--` go to `orca bench` as they are. The machine's load average is printed with
each run, since the figures are only comparable within one sitting.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from collections import defaultdict

ROLES = (  # (role, substring of the command line), first match wins
    ("proxy", "ray::ProxyActor"), ("replica", "ray::ServeReplica:orca-gateway"), ("worker", "ray::Worker"),
    ("master", "ray::EngineMasterActor"), ("tokenizer", "services.tokenizer"), ("nats", "nats-server"),
    ("admission", "services.admission"), ("controller", "ray::ServeController"), ("raylet", "/raylet"),
    ("gcs", "gcs_server"), ("driver", "services.cli serve"), ("haproxy", "haproxy"),
)
TICKS = os.sysconf("SC_CLK_TCK")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def children(root: int) -> set[int]:
    """`root` and every process below it."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    found, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        kids = [p for p, pp in parent.items() if pp == pid]
        found.update(kids)
        frontier.extend(kids)
    return found


def role_of(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "gone"
    return next((role for role, key in ROLES if key in cmdline), "other")


def cpu_seconds(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def snapshot(root: int) -> dict[int, tuple[str, float]]:
    return {pid: (role_of(pid), cpu_seconds(pid)) for pid in children(root)}


def by_role(before: dict, after: dict) -> dict[str, float]:
    spent: dict[str, float] = defaultdict(float)
    for pid, (role, seconds) in after.items():
        spent[role] += seconds - before.get(pid, (role, 0.0))[1]
    return dict(spent)


def bench(transport: str, args: argparse.Namespace, extra: list[str]) -> tuple[dict, float]:
    """One `orca bench` run (as the CLI runs it: OpenMP waits passive) : its saved result and the CPU seconds the bench process itself spent
    (for `inprocess`, the engine's: it runs inside the bench process)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, "-m", "services.cli", "bench", "--transport", transport, "--disable-tqdm",
               "--save-result", out.name, *extra]
        cmd += {"http": ["--base-url", args.base_url], "nats": ["--nats-url", args.nats_url],
                "inprocess": ["--model", args.model] if args.model else []}[transport]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        with open(out.name) as f:
            return json.load(f), (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def metrics_of(result: dict) -> dict:
    runs = result.get("runs") or [result]
    return runs[0].get("metrics", runs[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve-pid", type=int, default=None, help="the `orca serve` process (http, nats runs)")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    parser.add_argument("--model", default=None, help="checkpoint of the inprocess runs (default: the demo model)")
    parser.add_argument("--runs", nargs="+", default=["http", "nats"], choices=("http", "nats", "inprocess"))
    parser.add_argument("--label", default="")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    roles = [r for r, _ in ROLES] + ["other", "client"]
    print(f"{'label':<12}{'transport':<10}{'load':>6}{'tok/s':>7}{'tokens':>7} "
          + "".join(f"{r[:9]:>10}" for r in roles) + "   (us CPU per streamed token)")
    for transport in args.runs:
        load = os.getloadavg()[0]
        before = snapshot(args.serve_pid) if args.serve_pid and transport != "inprocess" else {}
        result, client_s = bench(transport, args, extra)
        spent = by_role(before, snapshot(args.serve_pid)) if before else {}
        spent["worker" if transport == "inprocess" else "client"] = client_s
        m = metrics_of(result)
        tokens = m["total_output_tokens"]
        print(f"{args.label:<12}{transport:<10}{load:>6.2f}{m['output_throughput']:>7.0f}{tokens:>7.0f} "
              + "".join(f"{1e6 * spent.get(r, 0.0) / tokens:>10.0f}" for r in roles), flush=True)


if __name__ == "__main__":
    main()
