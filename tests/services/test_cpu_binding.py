"""orca serve's core layout: each worker its own cores, the control plane the rest."""

import os
import select
import signal
import subprocess
import sys
import time

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
        "tasks = []\n"
        "for tid in os.listdir('/proc/self/task'):\n"
        "    try:\n"
        "        tasks.append(os.sched_getaffinity(int(tid)))\n"
        "    except ProcessLookupError:\n"
        "        pass  # t, joined, may still be listed a moment after it ended\n"
        f"assert seen == [{{{core}}}] and len(tasks) >= 2 and all(t == {{{core}}} for t in tasks), (seen, tasks)\n"
        "early.set()\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_a_thread_that_ends_while_the_process_is_bound_does_not_stop_the_binding(monkeypatch):
    from services import cpu_binding

    listed = os.listdir("/proc/self/task") + [str(2**30)]  # a thread id beyond pid_max: one that has ended
    monkeypatch.setattr(cpu_binding.os, "listdir", lambda path: listed)
    own = os.sched_getaffinity(0)
    assert cpu_binding.bind_this_process(sorted(own))  # its own cores: this test process stays as it was
    assert os.sched_getaffinity(0) == own


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2, reason="Linux, 2 cores")
@pytest.mark.parametrize("started_on_control_cores", [False, True], ids=["fresh", "restarted"])
def test_a_worker_borrows_the_control_cores_only_for_a_team_larger_than_its_own(started_on_control_cores):
    """`restarted`: a worker Ray starts again after `orca serve` bound its control plane (the raylet
    too) starts on the control plane's cores alone; OpenMP dropped the worker's own core from its places."""
    control, own = sorted(os.sched_getaffinity(0))[:2]
    script = (
        "import os, sys\n"
        + (f"os.sched_setaffinity(0, {{{control}}})\n" if started_on_control_cores else "")
        + "from services.cpu_binding import bind_this_process, place_openmp_threads\n"
        f"assert place_openmp_threads([{own}], [{control}]) == 1\n"
        f"assert bind_this_process([{own}])\n"
        "assert 'OMP_PLACES' not in os.environ  # read at load: not passed on to children bound to fewer cores\n"
        "import torch\n"
        "a = torch.randn(256, 256)\n"
        "def run(threads):\n"
        "    torch.set_num_threads(threads)\n"
        "    for _ in range(10): a @ a\n"
        "    return sorted(sorted(os.sched_getaffinity(int(t))) for t in os.listdir('/proc/self/task'))\n"
        "print(run(1)); print(run(2)); print(sorted(os.sched_getaffinity(0)))\n"
        f"assert place_openmp_threads([{own}], [{control}]) == 0  # OpenMP is loaded: too late\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert done.returncode == 0, done.stderr
    one_thread, two_threads, main = done.stdout.split("\n")[:3]
    assert f"[{control}]" not in one_thread, "a team of the worker's own size stays on its core"
    assert two_threads.count(f"[{control}]") == 1, "a larger team's extra thread runs on the borrowed core"
    assert main == f"[{own}]"
    assert "keeps to its own cores" in done.stderr
    assert "Number of places reduced" not in done.stderr, done.stderr


CHILD = r"""
import os, sys, threading, time
if sys.argv[1] == "worker":
    os.sched_setaffinity(0, {int(sys.argv[2])})  # a model worker binds itself as it starts
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()  # a thread started before the binding
os.write(1, b"ready\n")
sys.stdin.readline()
threads = set().union(*(os.sched_getaffinity(int(t)) for t in os.listdir("/proc/self/task")))
os.write(1, f"{sorted(os.sched_getaffinity(0))} {sorted(threads)}\n".encode())  # one write: two processes share the pipe
time.sleep(60)
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2, reason="Linux, 2 cores")
def test_a_stack_binds_every_thread_of_its_tree_to_the_control_cores_but_the_workers():
    from services.cpu_binding import bind_process_tree

    control, worker = sorted(os.sched_getaffinity(0))[:2]
    # orca serve -> a service, and -> a launcher (like Ray's raylet) -> a worker bound to its own core
    launcher = ("import subprocess, sys\n"
                f"w = subprocess.Popen([sys.executable, '-c', {CHILD!r}, 'worker', '{worker}'], stdin=sys.stdin)\n"
                "w.wait()\n")
    root = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time\n"
                             f"s = subprocess.Popen([sys.executable, '-c', {CHILD!r}, 'service'], stdin=subprocess.PIPE, stdout=sys.stdout)\n"
                             f"l = subprocess.Popen([sys.executable, '-c', {launcher!r}], stdin=subprocess.PIPE, stdout=sys.stdout)\n"
                             "sys.stdin.readline(); s.stdin.write(b'go\\n'); s.stdin.flush(); l.stdin.write(b'go\\n'); l.stdin.flush()\n"
                             "time.sleep(60)\n"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    lines = LineReader(root.stdout.fileno())
    try:
        assert [lines.next() for _ in range(2)] == ["ready", "ready"]
        assert bind_process_tree(root.pid, [control], [worker]) > 0
        root.stdin.write("go\n")
        root.stdin.flush()
        seen = sorted(lines.next() for _ in range(2))
        assert seen == sorted([f"[{control}] [{control}]", f"[{worker}] [{worker}]"])
        assert os.sched_getaffinity(root.pid) == {control}
        assert len(os.sched_getaffinity(0)) > 1, "the caller itself is not in the tree"
    finally:
        os.killpg(root.pid, signal.SIGKILL)  # the whole tree: it is the session's process group
        root.wait()


class LineReader:
    """Lines from a pipe, each within a deadline (a child that died would otherwise hang the test)."""

    def __init__(self, fd: int, timeout_s: float = 20.0) -> None:
        self.fd, self.timeout_s, self.buffer = fd, timeout_s, b""

    def next(self) -> str:
        deadline = time.monotonic() + self.timeout_s
        while b"\n" not in self.buffer:
            ready, _, _ = select.select([self.fd], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(self.fd, 4096) if ready else b""
            assert chunk, "no line from the process tree in time (a child failed?)"
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode().strip()
