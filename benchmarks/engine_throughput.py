"""Offline throughput on the Orca paper's workload shape, measured side by side in one run.

Prints tokens/s of the `orca` and `request-level` policies (and their ratio), and the
engine's efficiency: the time of a bare loop that replays the very same forward passes
(the iterations the `orca` run scheduled) through the model runner with no scheduling,
detokenization or bookkeeping, divided by the engine's time.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 \
        python benchmarks/engine_throughput.py --model .cache/demo-llama --num-requests 128
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shared.env import prefer_passive_openmp  # noqa: E402

prefer_passive_openmp()  # as `orca generate` does, before torch is imported
import torch  # noqa: E402

from benchmarks.common import engine_parser, make_engine, write_summary  # noqa: E402
from benchmarks.workload import orca_paper_workload  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from model.runner import ModelRunner  # noqa: E402
from shared.config import CacheConfig  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402


def length_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    return int(low), int(high or low)


def run_engine(engine: LLMEngine, workload: list[dict], label: str) -> dict:
    for r in workload:
        engine.add_request(r["id"], r["prompt_token_ids"],
                           SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True))
    generated = iterations = 0
    cpu_start, start = time.process_time(), time.perf_counter()  # process_time: all threads of this process
    while engine.has_unfinished:
        generated += sum(len(d.new_token_ids) for d in engine.step())
        iterations += 1
        if iterations % 50 == 0:
            print(f"  [{label}] iteration {iterations}, {generated} tokens", file=sys.stderr)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    assert engine.kv_cache.num_used_blocks == 0
    return {"policy": label, "seconds": seconds, "generated_tokens": generated, "iterations": iterations,
            "tokens_per_s": generated / seconds, "cpu_seconds": cpu_seconds,
            "cpu_seconds_per_token": cpu_seconds / max(generated, 1)}


def warm_up(engine: LLMEngine) -> None:
    engine.add_request("warmup", list(range(10, 74)), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished:
        engine.step()


def bare_loop(args: argparse.Namespace, iterations: list, max_model_len: int) -> float:
    """Replay the recorded iterations through a fresh runner: forward passes and sampling only."""
    cache = CacheConfig(kv_cache_tokens=args.kv_cache_tokens, block_size=args.block_size)
    runner = ModelRunner(args.model, dtype=args.dtype, device="cpu", num_blocks=cache.num_blocks,
                         block_size=cache.block_size, max_model_len=max_model_len, seed=0)
    runner.execute(iterations[0])  # warm-up on the first iteration's shapes is not timed twice:
    runner.requests.clear()
    start = time.perf_counter()
    for scheduler_output in iterations:
        runner.execute(scheduler_output)
    return time.perf_counter() - start


def single_stream_latency(engine: LLMEngine, prompt: list[int], decode_tokens: int = 128,
                          repeats: int = 3) -> dict:
    """One request alone: TTFT (a 1-token request) and decode ms/token, (t(1 + n) - t(1)) / n; best of repeats
    (the same measurement benchmarks/vllm_baseline.py makes)."""
    def timed(max_tokens: int) -> float:
        best = float("inf")
        for i in range(repeats):
            start = time.perf_counter()
            engine.add_request(f"single-{max_tokens}-{i}", prompt,
                               SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
            while engine.has_unfinished:
                engine.step()
            best = min(best, time.perf_counter() - start)
        return best

    first = timed(1)
    return {"ttft_ms": round(1e3 * first, 2),
            "decode_ms_per_token": round(1e3 * (timed(1 + decode_tokens) - first) / decode_tokens, 3)}


def main() -> None:
    # --scheduler is not read: orca and request-level both run (orca alone with --only-orca)
    parser = engine_parser(__doc__, num_requests=256, kv_cache_tokens=131072)
    parser.add_argument("--input-len", type=length_range, default=(32, 512), help="prompt lengths LOW:HIGH, uniform")
    parser.add_argument("--output-len", type=length_range, default=(1, 128), help="output lengths LOW:HIGH, uniform")
    parser.add_argument("--only-orca", action="store_true", help="skip the request-level run and the bare loop")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one per core)")
    parser.add_argument("--write-workload", help="also write the workload as JSONL (for the vLLM baseline)")
    parser.add_argument("--out", help="write the results as JSON")
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    workload = orca_paper_workload(args.num_requests, args.seed, input_range=args.input_len,
                                   output_range=args.output_len)
    if args.write_workload:
        with open(args.write_workload, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in workload)
    results = {}
    bare_seconds = 0.0
    for policy in ("orca",) if args.only_orca else ("orca", "request-level"):
        engine = make_engine(args, policy)  # stream_text=False, as `orca generate` runs it
        warm_up(engine)
        engine.record_iterations = policy == "orca"
        results[policy] = run_engine(engine, workload, policy)
        engine.record_iterations = False
        iterations = list(engine.iterations)  # the run's alone: the single stream below is not replayed
        if policy == "orca":
            results[policy]["single_stream"] = single_stream_latency(engine, workload[0]["prompt_token_ids"][:64])
        print(json.dumps(results[policy]), file=sys.stderr)
        if policy == "orca" and not args.only_orca:  # replayed right after the run it replays, in the same conditions
            bare_seconds = bare_loop(args, iterations, engine.max_model_len)
        del engine
    orca = results["orca"]
    (lo_in, hi_in), (lo_out, hi_out) = args.input_len, args.output_len
    summary = {
        "workload": f"{args.num_requests} requests, input U[{lo_in},{hi_in}], output U[{lo_out},{hi_out}], EOS ignored",
        "orca_tokens_per_s": round(orca["tokens_per_s"], 1),
        "engine_seconds": round(orca["seconds"], 3),
        "threads": threads,
        "tcmalloc": "tcmalloc" in os.environ.get("LD_PRELOAD", ""),
        "results": results,
    }
    if not args.only_orca:
        baseline = results["request-level"]
        summary.update({
            "request_level_tokens_per_s": round(baseline["tokens_per_s"], 1),
            "orca_over_request_level": round(orca["tokens_per_s"] / baseline["tokens_per_s"], 3),
            "bare_loop_seconds": round(bare_seconds, 3),
            "engine_efficiency": round(bare_seconds / orca["seconds"], 3),
        })
    write_summary(summary, args.out)


if __name__ == "__main__":
    main()
