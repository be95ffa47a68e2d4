"""Orca's reservation vs the successors' answers, measured side by side in one run.

Part 1, same KV memory budget: how many requests run at once and tokens/s, for `orca`
(reserves prompt + max_tokens at admission), `paged` (blocks on demand, preemption) and
`paged` with prefix reuse, on the Orca paper's workload shape.

Part 2, decode stalls: short requests decode while long prompts keep arriving; the worst and
p99 inter-token latency of the decoding requests, with and without chunked prefill.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 \
        python benchmarks/policies.py --model .cache/demo-llama
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import write_summary  # noqa: E402
from benchmarks.workload import orca_paper_workload  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from shared.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402


def engine(model: str, policy: str, kv_tokens: int, max_num_seqs: int = 256, chunk: int | None = None,
           prefix: bool = False) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(model=model, dtype="float32"),
        scheduler=SchedulerConfig(policy=policy, max_num_seqs=max_num_seqs, max_num_batched_tokens=chunk,
                                  enable_chunked_prefill=chunk is not None),
        cache=CacheConfig(kv_cache_tokens=kv_tokens, block_size=16, enable_prefix_caching=prefix),
    ))


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def same_budget(args: argparse.Namespace) -> dict:
    workload = orca_paper_workload(args.num_requests, args.seed)
    results = {}
    for label, policy, prefix in (("orca", "orca", False), ("paged", "paged", False),
                                  ("paged+prefix", "paged", True)):
        e = engine(args.model, policy, args.kv_cache_tokens, prefix=prefix)
        for r in workload:
            e.add_request(r["id"], r["prompt_token_ids"], greedy(r["max_tokens"]))
        generated, max_running, start = 0, 0, time.perf_counter()
        while e.has_unfinished:
            generated += sum(len(d.new_token_ids) for d in e.step())
            max_running = max(max_running, len(e.scheduler.running))
        seconds = time.perf_counter() - start
        results[label] = {"max_concurrent_requests": max_running, "tokens_per_s": round(generated / seconds, 1),
                          "preemptions": e.scheduler.num_preemptions, "iterations": e.scheduler.iteration}
        print(f"  {label}: {results[label]}", file=sys.stderr)
        del e
    return results


def decode_stalls(args: argparse.Namespace, chunk: int | None) -> dict:
    rng = random.Random(args.seed)
    e = engine(args.model, "orca", 65536, chunk=chunk)
    for i in range(16):
        e.add_request(f"short-{i}", [rng.randrange(10, 4000) for _ in range(32)], greedy(160))
    last_token: dict[str, float] = {}
    gaps: list[float] = []
    step = 0
    while e.has_unfinished:
        if step % 8 == 4 and step < 120:  # a long prompt arrives every 8 iterations
            e.add_request(f"long-{step}", [rng.randrange(10, 4000) for _ in range(args.long_prompt)], greedy(4))
        deltas = e.step()
        now = time.perf_counter()
        for d in deltas:
            rid = d.completion.request_id
            if rid.startswith("short") and d.new_token_ids:
                if rid in last_token:
                    gaps.append(now - last_token[rid])
                last_token[rid] = now
        step += 1
    gaps.sort()
    return {"max_inter_token_ms": round(1000 * gaps[-1], 1), "p99_inter_token_ms": round(1000 * gaps[int(0.99 * len(gaps))], 1),
            "median_inter_token_ms": round(1000 * gaps[len(gaps) // 2], 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--kv-cache-tokens", type=int, default=16384, help="the shared KV budget of part 1")
    parser.add_argument("--long-prompt", type=int, default=900)
    parser.add_argument("--chunk", type=int, default=256, help="token budget with chunked prefill")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out")
    args = parser.parse_args()
    summary = {"same_kv_budget": same_budget(args),
               "decode_stall_without_chunking": decode_stalls(args, None),
               "decode_stall_with_chunked_prefill": decode_stalls(args, args.chunk),
               "kv_cache_tokens": args.kv_cache_tokens, "num_requests": args.num_requests,
               "tcmalloc": "tcmalloc" in os.environ.get("LD_PRELOAD", "")}
    write_summary(summary, args.out)


if __name__ == "__main__":
    main()
