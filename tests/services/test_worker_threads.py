"""orca serve's default thread layout: the model's workers share the cores less one."""

import pytest

from services.serve import default_worker_threads


@pytest.mark.parametrize(("cpus", "workers", "threads"), [(2, 1, 1), (1, 1, 1), (16, 1, 15), (16, 4, 3), (8, 16, 1)])
def test_one_core_is_left_to_the_control_plane(cpus, workers, threads):
    assert default_worker_threads(cpus, workers) == threads
