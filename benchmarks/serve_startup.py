"""How long `orca serve` takes from its start to "orca-serve is up" (HTTP /health 200), and to each
milestone it prints on the way, as a user waits for it.

Each run starts `orca serve --model MODEL --port 0` in a fresh process with cwd and PYTHONPATH
`--repo`, reads its output until it is up, then stops it with SIGTERM and waits for it to exit
before the next run. To compare against an older commit, check it out beside this one and point
`--repo` at it (same venv):

    git worktree add /tmp/before COMMIT
    .venv/bin/python benchmarks/serve_startup.py --model .cache/demo-llama --repo /tmp/before
    .venv/bin/python benchmarks/serve_startup.py --model .cache/demo-llama
    git worktree remove --force /tmp/before
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MILESTONES = {"services ready": "orca-tokenizer: ready", "gateway deployed": "Application 'orca-gateway' is ready",
              "up": "orca-serve is up"}
"""What a run waits for in `orca serve`'s output, by the name the table gives it."""


def start_once(repo: str, model: str, timeout_s: float) -> dict[str, float]:
    """Seconds from the start of one `orca serve` to each milestone (all of them, or a RuntimeError)."""
    env = {**os.environ, "PYTHONPATH": repo}
    command = [sys.executable, "-u", "-m", "services.cli", "serve", "--model", model, "--port", "0"]
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    seen: dict[str, float] = {}
    try:
        for line in process.stdout:
            for name, text in MILESTONES.items():
                if name not in seen and text in line:
                    seen[name] = time.perf_counter() - started
            if "up" in seen or time.perf_counter() - started > timeout_s:
                break
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    if "up" not in seen:
        raise RuntimeError(f"orca serve in {repo} was not up within {timeout_s:.0f} s (saw {sorted(seen)})")
    return seen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="checkpoint directory (orca make-demo-model DIR)")
    parser.add_argument("--repo", default=ROOT, help="the checkout whose orca serve to start")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()
    runs = []
    for i in range(args.runs):
        runs.append(start_once(os.path.abspath(args.repo), os.path.abspath(args.model), args.timeout))
        print(f"run {i + 1}/{args.runs}: " + ", ".join(f"{k} {v:.1f} s" for k, v in runs[-1].items()),
              file=sys.stderr, flush=True)
    print(f"orca serve start-up, {args.repo}, {args.runs} runs, load average {os.getloadavg()[0]:.2f}")
    print("| milestone | median s | min s | max s |\n|---|---|---|---|")
    for name in MILESTONES:
        values = [run[name] for run in runs if name in run]
        if values:
            print(f"| {name} | {statistics.median(values):.1f} | {min(values):.1f} | {max(values):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
