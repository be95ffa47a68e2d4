"""What `orca serve` and each engine master say when the Ray cluster cannot hold the workers."""

import pytest

from services.engine.placement import cluster_shortfall, missing_resources, worker_bundle


def test_workers_that_fit_have_no_shortfall_busy_or_not():
    assert cluster_shortfall(2, {"CPU": 1.0}, {"CPU": 2.0}, what="x") is None


def test_every_replica_counts_so_a_third_that_cannot_fit_is_named_with_the_numbers():
    message = cluster_shortfall(3 * 1, worker_bundle("cpu", 1.0), {"CPU": 2.0, "memory": 1e9},
                                what="3 engine replica(s) of tp=1 pp=1")
    assert message == ("3 engine replica(s) of tp=1 pp=1 needs 3 worker(s) of {'CPU': 1.0} = {'CPU': 3.0} in all, "
                       "but the Ray cluster has {'CPU': 2.0} (missing {'CPU': 1.0}); "
                       "lower -tp/-pp, --replicas or --worker-cpus, or add nodes")


def test_a_cuda_worker_needs_a_gpu_and_a_cluster_without_one_lacks_all_of_them():
    bundle = worker_bundle("cuda:0", 0.5)
    assert bundle == {"CPU": 0.5, "GPU": 1.0}
    assert missing_resources({k: v * 4 for k, v in bundle.items()}, {"CPU": 8.0}) == {"GPU": 4.0}


def test_a_fractional_share_that_adds_up_exactly_fits():
    assert cluster_shortfall(4, {"CPU": 0.25}, {"CPU": 1.0}, what="x") is None


def test_a_split_this_machine_cannot_hold_is_refused_before_a_local_ray_starts():
    """`orca serve` without --ray-address checks against this machine's CPUs first (no Ray needed)."""
    from services.serve import check_engines_fit
    from shared.config import EngineConfig, ModelConfig, ParallelConfig, ServeConfig

    config = EngineConfig(model=ModelConfig(model="unused"),
                          parallel=ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2))
    with pytest.raises(ValueError, match=r"a local Ray on this machine has \{'CPU': 2\.0\} .*--ray-address"):
        check_engines_fit(config, ServeConfig(worker_cpus=1.0), local_cpus=2)
    check_engines_fit(config, ServeConfig(worker_cpus=0.5), local_cpus=2)  # four halves fit


def test_only_a_ray_that_orca_serve_starts_itself_is_checked_against_this_machine(monkeypatch):
    from services.serve import starts_local_ray

    assert not starts_local_ray("10.0.0.5:6379")
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")  # ray.init(address=None) joins that cluster
    assert not starts_local_ray(None)


@pytest.mark.slow
def test_on_a_cluster_that_grows_missing_devices_are_waited_for_not_refused():
    """KubeRay's autoscaler adds a GPU pod only for a placement group that waits: refused at once, the
    RayService's engines never got one. A fixed cluster (`orca serve`) still refuses at once."""
    import time

    import ray

    from services.engine.placement import PlacementError, reserve_workers

    ray.init(num_cpus=1, num_gpus=0, include_dashboard=False, log_to_driver=False)
    try:
        gpu_worker = worker_bundle("cuda", 1.0)
        began = time.monotonic()
        with pytest.raises(PlacementError, match=r"missing \{'GPU': 1.0\}"):
            reserve_workers(1, gpu_worker, what="engine 0")
        assert time.monotonic() - began < 5
        began = time.monotonic()
        with pytest.raises(PlacementError, match="waited 3 s for the autoscaler to add them"):
            reserve_workers(1, gpu_worker, what="engine 0", timeout_s=0.5, autoscaler_wait_s=3.0)
        assert 3.0 <= time.monotonic() - began < 15
        assert ray.util.placement_group_table() == {} or all(
            g["state"] == "REMOVED" for g in ray.util.placement_group_table().values()), "no group left waiting"
    finally:
        ray.shutdown()
