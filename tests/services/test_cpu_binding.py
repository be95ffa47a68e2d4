"""orca serve's core layout: each worker its own cores, the control plane the rest."""

import os
import subprocess
import sys

import pytest

from services.cpu_binding import CpuLayout, plan_cpu_layout


@pytest.mark.parametrize(("cpus", "workers", "threads", "layout"), [
    ([0, 1], 1, 1, CpuLayout((0,), ((1,),))),
    ([0, 1, 2, 3], 1, 3, CpuLayout((0,), ((1, 2, 3),))),
    ([0, 1, 2, 3, 4, 5, 6, 7], 2, 3, CpuLayout((0, 1), ((2, 3, 4), (5, 6, 7)))),
    ([5, 3, 9], 2, 1, CpuLayout((3,), ((5,), (9,)))),  # a taskset's cores, in any order
])
def test_workers_get_the_last_cores_and_the_control_plane_the_rest(cpus, workers, threads, layout):
    assert plan_cpu_layout(cpus, workers, threads) == layout


@pytest.mark.parametrize(("cpus", "workers", "threads"), [([0], 1, 1), ([0, 1], 2, 1), ([0, 1], 1, 2), ([0, 1], 0, 1)])
def test_nothing_is_bound_when_the_control_plane_would_have_no_core(cpus, workers, threads):
    assert plan_cpu_layout(cpus, workers, threads) is None


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_a_bound_process_and_the_threads_it_starts_later_stay_on_its_cores():
    core = min(os.sched_getaffinity(0))
    script = (
        "import os, threading\n"
        "from services.cpu_binding import bind_this_process\n"
        "early = threading.Event(); threading.Thread(target=early.wait, daemon=True).start()\n"
        f"assert bind_this_process([{core}])\n"
        "seen = []\n"
        "t = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0))); t.start(); t.join()\n"
        "tasks = [os.sched_getaffinity(int(tid)) for tid in os.listdir('/proc/self/task')]\n"
        f"assert seen == [{{{core}}}] and all(t == {{{core}}} for t in tasks), (seen, tasks)\n"
        "early.set()\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))
