"""Reserve the devices of one engine's workers on the Ray cluster, or say what is missing.

One bundle per worker (a GPU each on CUDA, a share of CPU here), packed onto as few nodes as
possible so tensor-parallel peers share a node's fast links. A request the cluster can never
satisfy fails at once with the numbers; one that is only busy waits up to `timeout_s`.
"""

from __future__ import annotations

from typing import Any


class PlacementError(RuntimeError):
    pass


def worker_bundle(device: str, worker_cpus: float) -> dict[str, float]:
    bundle = {"CPU": worker_cpus}
    if device.startswith("cuda"):
        bundle["GPU"] = 1.0
    return bundle


def missing_resources(needed: dict[str, float], total: dict[str, float]) -> dict[str, float]:
    """What the cluster lacks, resource by resource, to hold `needed` at all."""
    return {k: v - total.get(k, 0.0) for k, v in needed.items() if total.get(k, 0.0) + 1e-9 < v}


def cluster_shortfall(num_workers: int, bundle: dict[str, float], total: dict[str, float], *, what: str,
                      cluster: str = "the Ray cluster", grow: str = "add nodes") -> str | None:
    """What is missing for `num_workers` bundles on `cluster` of `total` resources, said for a user
    (with `grow`: how to get more); None when they fit (busy or not)."""
    needed = {k: v * num_workers for k, v in bundle.items()}
    lacking = missing_resources(needed, total)
    if not lacking:
        return None
    have = {k: total.get(k, 0.0) for k in needed}
    return (f"{what} needs {num_workers} worker(s) of {bundle} = {needed} in all, but {cluster} has {have} "
            f"(missing {lacking}); lower -tp/-pp, --replicas or --worker-cpus, or {grow}")


def reserve_workers(num_workers: int, bundle: dict[str, float], *, what: str, name: str = "",
                    timeout_s: float = 60.0, autoscaler_wait_s: float | None = None) -> Any:
    """A ready placement group of `num_workers` bundles, or PlacementError saying what is missing.
    A group `name`d so already exists when a master restarts (a group outlives the actor that made
    it, its workers do not): it is taken over, since its devices are held for nobody else.
    `autoscaler_wait_s`: on a cluster that grows (KubeRay's autoscaler adds pods for the placement
    groups that wait), what the nodes up now lack is waited for that long, not refused at once (no
    group would wait, and the autoscaler would never see the demand)."""
    import ray
    from ray.util.placement_group import get_placement_group, placement_group, remove_placement_group

    if name:
        try:
            group = get_placement_group(name)
        except ValueError:
            pass
        else:
            if group.bundle_specs == [dict(bundle) for _ in range(num_workers)]:
                # ray.wait, not ray.get: a master calls this from a thread, and Ray warns of a blocking
                # ray.get in an async actor at every restart (its loop is not blocked: the thread is)
                if ray.wait([group.ready()], timeout=timeout_s)[0]:
                    return group
                raise PlacementError(f"{what}: the placement group {name} of a previous master was not ready "
                                     f"after {timeout_s:.0f} s")
            remove_placement_group(group)  # made for other flags: give its devices back
    shortfall = cluster_shortfall(num_workers, bundle, ray.cluster_resources(), what=what)
    if shortfall and autoscaler_wait_s is None:
        raise PlacementError(shortfall)
    wait_s = max(timeout_s, autoscaler_wait_s or 0.0) if shortfall else timeout_s
    group = placement_group([dict(bundle) for _ in range(num_workers)], strategy="PACK", name=name)
    ready, _ = ray.wait([group.ready()], timeout=wait_s)
    if not ready:
        remove_placement_group(group)
        if shortfall:
            raise PlacementError(f"{shortfall} (waited {wait_s:.0f} s for the autoscaler to add them)")
        raise PlacementError(
            f"{what}: no room for {num_workers} worker(s) of {bundle} after {timeout_s:.0f} s; the cluster has "
            f"{ray.available_resources()} free now (other engines hold the rest)")
    return group
