"""Device check of the model step: one command, a few minutes on one H100/H200-class GPU.

    python benchmarks/gpu_step_check.py --out results.json            # on a CUDA machine
    python benchmarks/gpu_step_check.py --device cpu --size tiny      # a smoke run of the same code on CPU

For a demo Llama made on the spot (random weights, `--size`):
1. correctness: greedy tokens of the compiled step (torch.compile + CUDA graphs for decode sizes) equal
   the eager step's in float32, and the eager Triton step's equal the plain torch step's; in bfloat16,
   the share of requests whose tokens agree between compiled and eager is reported (no bit-exactness
   is expected there);
2. speed: offline output tokens/s on 64 requests, and TTFT / TPOT at batch 1 and batch 64, for the
   eager and the compiled step.
Exits 0 only if every correctness check passed; writes every figure to --out.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.llm_engine import LLMEngine  # noqa: E402
from model.demo import make_demo_model  # noqa: E402
from shared.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402


def workload(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(10, 4000) for _ in range(rng.randint(16, 256))], rng.randint(8, 128)) for _ in range(n)]


def engine(args: argparse.Namespace, dtype: str, *, eager: bool, backend: str = "auto") -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(model=args.model, dtype=dtype, device=args.device, kernel_backend=backend,
                          enforce_eager=eager),
        scheduler=SchedulerConfig(max_num_seqs=256), cache=CacheConfig(kv_cache_tokens=65536)))


def run(eng: LLMEngine, requests: list[tuple[list[int], int]]) -> dict:
    """All requests at once; tokens per request, output tok/s, and per-request TTFT and TPOT."""
    start = time.perf_counter()
    for i, (prompt, max_tokens) in enumerate(requests):
        eng.add_request(str(i), prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    done = {}
    while eng.has_unfinished:
        for delta in eng.step():
            if delta.finished:
                done[int(delta.completion.request_id)] = delta.completion
    seconds = time.perf_counter() - start
    tokens = [done[i].token_ids for i in range(len(requests))]
    ttft = [done[i].first_token_time - done[i].arrival_time for i in done]
    tpot = [(done[i].finished_time - done[i].first_token_time) / max(len(done[i].token_ids) - 1, 1) for i in done]
    return {"tokens": tokens, "out_tok_per_s": sum(map(len, tokens)) / seconds,
            "ttft_ms_median": 1e3 * sorted(ttft)[len(ttft) // 2], "tpot_ms_median": 1e3 * sorted(tpot)[len(tpot) // 2]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--size", default="small", choices=["tiny", "small"])
    p.add_argument("--model", default=None, help="a checkpoint directory (default: a demo Llama made now)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.model is None:
        args.model = str(make_demo_model(Path(tempfile.mkdtemp()) / "llama", arch="llama", size=args.size))
    results: dict = {"device": args.device, "size": args.size, "checks": {}, "speed": {}}
    reqs = workload(args.num_requests)
    small = reqs[:8]
    dtypes = ["float32", "bfloat16"] if args.device.startswith("cuda") else ["float32"]
    for dtype in dtypes:
        for eager in (True, False):
            t0 = time.perf_counter()
            eng = engine(args, dtype, eager=eager)
            start_s = time.perf_counter() - t0
            label = f"{dtype} {'eager' if eager else 'compiled'}"
            batch = run(eng, reqs)
            single = run(eng, reqs[:1])
            results["speed"][label] = {"start_s": start_s, "out_tok_per_s": batch["out_tok_per_s"],
                                       "batch64_ttft_ms": batch["ttft_ms_median"],
                                       "batch64_tpot_ms": batch["tpot_ms_median"],
                                       "batch1_ttft_ms": single["ttft_ms_median"],
                                       "batch1_tpot_ms": single["tpot_ms_median"]}
            results.setdefault("tokens", {})[label] = batch["tokens"]
            print(label, {k: round(v, 2) for k, v in results["speed"][label].items()}, flush=True)
        same = [a == b for a, b in zip(results["tokens"][f"{dtype} eager"], results["tokens"][f"{dtype} compiled"])]
        results["checks"][f"{dtype}: compiled tokens equal eager"] = {"agree": sum(same) / len(same),
                                                                      "required": dtype == "float32"}
    reference = run(engine(args, "float32", eager=True, backend="torch"), small)["tokens"]
    same = [a == b for a, b in zip(reference, results["tokens"]["float32 eager"][:len(small)])]
    results["checks"]["float32: default kernels equal the plain torch path"] = {"agree": sum(same) / len(same),
                                                                               "required": True}
    results.pop("tokens")
    passed = all(c["agree"] == 1.0 for c in results["checks"].values() if c["required"])
    print(json.dumps(results["checks"], indent=2))
    print("PASSED" if passed else "FAILED")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
