"""Start-up cost of each control-plane process: what a fresh interpreter spends importing the module
that process imports before it can serve, and whether torch came in with it (#17).

Each module is imported with `python -c "import X"` in a subprocess whose cwd and PYTHONPATH are
`--repo`, once to warm the bytecode cache and then `--runs` times; wall time is measured around the
subprocess, CPU time (user + system) from the children's rusage. Both include the interpreter's own
start, shown alone in the `(interpreter)` row. To compare against an older commit, check it out
beside this one and point `--repo` at it (same venv; the script checks each module came from there):

    git worktree add /tmp/before COMMIT
    nice -n 10 .venv/bin/python benchmarks/startup_times.py --repo /tmp/before
    nice -n 10 .venv/bin/python benchmarks/startup_times.py
    git worktree remove --force /tmp/before
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROCESSES = (  # (process, the module it imports before it serves)
    ("tokenizer", "services.tokenizer.__main__"), ("admission", "services.admission.__main__"),
    ("jobs", "services.jobs.__main__"), ("gateway replica", "services.gateway.app"),
    ("engine master actor", "services.engine.actor"),
)
# Prints where the module came from and whether torch / triton were loaded with it.
PROBE = "import sys, {module} as m; print(m.__file__, 'torch' in sys.modules, 'triton' in sys.modules)"


def import_once(module: str, repo: str) -> tuple[float, float, str]:
    """Wall seconds, CPU seconds and the probe's output of one fresh interpreter importing `module`."""
    code = PROBE.format(module=module) if module else "print('-', False, False)"  # the bare interpreter
    env = {**os.environ, "PYTHONPATH": repo}
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], cwd=repo, env=env, capture_output=True, text=True)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode != 0:
        raise RuntimeError(f"importing {module} in {repo} failed:\n{out.stderr}")
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return wall, cpu, out.stdout.strip().splitlines()[-1]


def measure(module: str, repo: str, runs: int) -> tuple[list[float], list[float], bool, bool]:
    """`runs` timed imports after one warm-up: wall and CPU seconds, torch and triton loaded."""
    _, _, probe = import_once(module, repo)
    path, torch, triton = probe.rsplit(" ", 2)
    if module and not os.path.realpath(path).startswith(os.path.realpath(repo) + os.sep):
        raise RuntimeError(f"{module} came from {path}, not from {repo}")
    walls, cpus = zip(*(import_once(module, repo)[:2] for _ in range(runs)))
    return list(walls), list(cpus), torch == "True", triton == "True"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", default=ROOT, help="the checkout whose modules are imported (default: this one)")
    parser.add_argument("--runs", type=int, default=5, help="timed imports per module, after one warm-up")
    args = parser.parse_args()
    commit = subprocess.run(["git", "-C", args.repo, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    print(f"repo {args.repo} at {commit or '?'}, {args.runs} runs, load {os.getloadavg()[0]:.2f}, ms")
    print(f"| {'process':<20} | {'module':<28} | wall median | wall min | CPU median | CPU min | torch | triton |")
    print(f"|{'-' * 22}|{'-' * 30}|------------:|---------:|-----------:|--------:|-------|--------|")
    for process, module in (("(interpreter)", ""), *PROCESSES):
        walls, cpus, torch, triton = measure(module, args.repo, args.runs)
        print(f"| {process:<20} | {module or '-':<28} | {1e3 * statistics.median(walls):>11.0f} "
              f"| {1e3 * min(walls):>8.0f} | {1e3 * statistics.median(cpus):>10.0f} | {1e3 * min(cpus):>7.0f} "
              f"| {'yes' if torch else 'no':<5} | {'yes' if triton else 'no':<6} |", flush=True)


if __name__ == "__main__":
    main()
