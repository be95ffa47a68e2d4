"""Pipeline bubbles with one batch in flight vs one per stage (Orca section 4.2's schedule).

Runs the same offline workload through the in-process engine split into --pp stages (worker
processes in a gloo group), once keeping 1 batch in flight and once keeping --pp, and prints
each stage's bubble fraction: the share of the run's wall time the stage spent idle (waiting
for the previous stage's activations or for its next step), from the workers' own timers.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 \\
        python benchmarks/pipeline_bubbles.py --model DIR --pp 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import engine_parser, make_engine  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402


def run(args: argparse.Namespace, in_flight: int) -> dict:
    engine = make_engine(args, stream_text=True, max_batches_in_flight=in_flight)
    try:
        rng = random.Random(args.seed)
        warm = [rng.randrange(10, 4000) for _ in range(32)]
        engine.add_request("warm-up", warm, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        while engine.has_unfinished:
            engine.step()
        before = engine.executor.stage_times()
        for i in range(args.num_requests):
            prompt = [rng.randrange(10, 4000) for _ in range(rng.randint(args.prompt_len // 2, args.prompt_len))]
            engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                                               ignore_eos=True))
        generated = iterations = 0
        start = time.perf_counter()
        while engine.has_unfinished:
            generated += sum(len(d.new_token_ids) for d in engine.step())
            iterations += 1
            if iterations % 100 == 0:
                print(f"  [{in_flight} in flight] iteration {iterations}, {generated} tokens", file=sys.stderr)
        wall = time.perf_counter() - start
        after = engine.executor.stage_times()
    finally:
        engine.close()
    stages = []
    for rank, (b, a) in enumerate(zip(before, after)):
        busy = (a.step_s - b.step_s) - (a.recv_wait_s - b.recv_wait_s)
        stages.append({"rank": rank, "busy_s": round(busy, 3), "bubble_fraction": round(1 - busy / wall, 3)})
    return {"batches_in_flight": in_flight, "wall_s": round(wall, 3), "iterations": iterations,
            "generated_tokens": generated, "tokens_per_s": round(generated / wall, 1),
            "bubble_fraction": round(sum(s["bubble_fraction"] for s in stages) / len(stages), 3), "stages": stages}


def main() -> None:
    parser = engine_parser(__doc__, num_requests=32, max_num_seqs=32, kv_cache_tokens=32768,
                           pipeline_parallel_size=2)
    # this script's older names of -tp and -pp (SUPPRESS: the defaults stay those of -tp and -pp)
    parser.add_argument("--tp", dest="tensor_parallel_size", type=int, default=argparse.SUPPRESS, help="as -tp")
    parser.add_argument("--pp", dest="pipeline_parallel_size", type=int, default=argparse.SUPPRESS, help="as -pp")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", help="also write the results as JSON")
    args = parser.parse_args()
    pp = args.pipeline_parallel_size
    results = [run(args, 1), run(args, pp)]
    for r in results:
        per_stage = ", ".join(f"rank {s['rank']}: {s['bubble_fraction']:.1%}" for s in r["stages"])
        print(f"{r['batches_in_flight']} batch(es) in flight: bubble fraction {r['bubble_fraction']:.1%} "
              f"({per_stage}); {r['tokens_per_s']} tok/s, {r['iterations']} iterations, {r['wall_s']} s")
    print(f"throughput ratio ({pp} vs 1 in flight): {results[1]['tokens_per_s'] / results[0]['tokens_per_s']:.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
