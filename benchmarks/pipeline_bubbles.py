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
import random
import sys
import time

from engine.llm_engine import LLMEngine
from shared.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from shared.sampling import SamplingParams


def run(args: argparse.Namespace, in_flight: int) -> dict:
    config = EngineConfig(
        model=ModelConfig(model=args.model, dtype=args.dtype),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs),
        cache=CacheConfig(kv_cache_tokens=args.kv_cache_tokens),
        parallel=ParallelConfig(tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp))
    engine = LLMEngine(config, max_batches_in_flight=in_flight)
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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--kv-cache-tokens", type=int, default=32768)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="also write the results as JSON")
    args = parser.parse_args()
    results = [run(args, 1), run(args, args.pp)]
    for r in results:
        per_stage = ", ".join(f"rank {s['rank']}: {s['bubble_fraction']:.1%}" for s in r["stages"])
        print(f"{r['batches_in_flight']} batch(es) in flight: bubble fraction {r['bubble_fraction']:.1%} "
              f"({per_stage}); {r['tokens_per_s']} tok/s, {r['iterations']} iterations, {r['wall_s']} s")
    print(f"throughput ratio ({args.pp} vs 1 in flight): {results[1]['tokens_per_s'] / results[0]['tokens_per_s']:.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
