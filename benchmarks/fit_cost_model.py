"""Fit the `this-machine` cost model of `orca simulate` from timed iterations of the in-process engine.

Runs the tiny demo model in process on a varied load: requests of the Orca paper's shape, kept
at a concurrency that changes at random among 1..64 (a jump up admits a burst at once), so
batches range from one lone decode to dozens of decodes and prefills of thousands of tokens. It
times every `LLMEngine.step()` (schedule + forward + sampling + update + detokenize: the whole
iteration, which is what the simulator replaces), and fits by least squares

    seconds = a + b * prefill_tokens + c * decode_tokens + d * decode_context

(decode_context: the KV entries the decode tokens attend to), with coefficients kept >= 0. They go
to `loadtest/fitted.py`. It prints the fit error on iterations held out from the fit (every 4th):
per iteration, and on their total time (what throughput depends on). On a shared machine an
iteration can be descheduled mid-way, so per-iteration errors are large; the total is the figure
to read.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 \\
        python benchmarks/fit_cost_model.py --model .cache/demo-llama --threads 1   # loadtest/fitted.py
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import sys
import textwrap
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from loadtest.cost_models import iteration_shapes, total  # noqa: E402
from loadtest.datasets import orca_paper_requests  # noqa: E402
from loadtest.targets import resolved_model  # noqa: E402
from shared.flags import add_engine_args, engine_config_from_args  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402

FEATURES = ("a", "b", "c", "d")
CONCURRENCY = (1, 2, 4, 8, 16, 32, 64)
ENGINE_FIELDS = ("model", "kv_cache_tokens")
"""The engine flags this script takes (the rest: the engine's defaults, the orca policy)."""
OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "loadtest", "fitted.py")


def collect(engine, num_requests: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Run the load; return features (one row per iteration) and measured seconds."""
    rng = random.Random(seed)
    pending = orca_paper_requests(num_requests, seed=seed, vocab_size=engine.vocab_size)
    prompt_lens: dict[str, int] = {}
    rows, seconds = [], []
    engine.record_iterations = True
    concurrency = 1
    while pending or engine.has_unfinished:
        if rng.random() < 0.02:  # now and then aim at another batch size: lone requests to big batches
            concurrency = rng.choice(CONCURRENCY)
        while pending and len(engine.scheduler.requests) < concurrency:  # a jump up joins as one burst
            r = pending.pop()
            engine.add_request(r.id, r.prompt_token_ids, SamplingParams(max_tokens=r.max_tokens, temperature=0.0,
                                                                        ignore_eos=True))
            prompt_lens[r.id] = len(r.prompt_token_ids)
        start = time.perf_counter()
        engine.step()
        seconds.append(time.perf_counter() - start)
        s = total(iteration_shapes(engine.iterations.pop(), prompt_lens))
        rows.append((1.0, s.prefill_tokens, s.decode_tokens, s.decode_context))
        if len(rows) % 200 == 0:
            print(f"  {len(rows)} iterations, {len(pending)} requests not yet sent", file=sys.stderr)
    return np.array(rows, dtype=float), np.array(seconds)


def fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: a feature whose coefficient comes out negative
    (noise, or two features that move together) is dropped and the rest refitted."""
    keep = np.ones(x.shape[1], dtype=bool)
    while True:
        coef = np.zeros(x.shape[1])
        coef[keep], *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
        if (coef >= 0).all():
            return coef
        keep &= coef > 0


def errors(x: np.ndarray, y: np.ndarray, coef: np.ndarray) -> dict[str, float]:
    pred = x @ coef
    return {"median_abs_pct": float(np.median(np.abs(pred - y) / y) * 100),
            "p90_abs_pct": float(np.percentile(np.abs(pred - y) / y, 90) * 100),
            "total_time_pct": float((pred.sum() - y.sum()) / y.sum() * 100),
            "r2": float(1 - ((pred - y) ** 2).sum() / ((y - y.mean()) ** 2).sum())}


def measure(args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray, int]:
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(engine_config_from_args(args, ENGINE_FIELDS, model=resolved_model(args.model)))
    collect(engine, 4, seed=args.seed + 1)  # warm-up, not fitted
    x, y = collect(engine, args.num_requests, args.seed)
    return x, y, engine.max_model_len


def held_out_errors(x: np.ndarray, y: np.ndarray) -> tuple[dict[str, float], dict[str, float]]:
    """Fit on 3 iterations in 4; errors on those and on the 4th (held out)."""
    held_out = np.arange(len(y)) % 4 == 3
    coef = fit(x[~held_out], y[~held_out])
    return errors(x[~held_out], y[~held_out], coef), errors(x[held_out], y[held_out], coef)


def write_fitted(path: str, coef: np.ndarray, max_model_len: int, kv_cache_tokens: int, note: str) -> None:
    lines = textwrap.wrap(note, 100)
    with open(path, "w", encoding="utf-8") as f:
        f.write(f'"""The this-machine cost model: generated by benchmarks/fit_cost_model.py on '
                f'{datetime.date.today()}; do not edit by hand."""\n\n')
        f.write("THIS_MACHINE = {\n" + "".join(f'    "{k}": {v!r},\n' for k, v in zip(FEATURES, coef.tolist()))
                + f'    "max_model_len": {max_model_len},\n'
                + f'    "default_kv_cache_tokens": {kv_cache_tokens},\n'
                + '    "note": (' + "\n             ".join(repr(line + " ") for line in lines) + "),\n}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser, ENGINE_FIELDS, defaults={"model": None},
                    helps={"model": "checkpoint directory (default: the demo model)"})
    parser.add_argument("--num-requests", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", default=OUT)
    parser.add_argument("--samples", help="also save the timed iterations (JSON) here")
    parser.add_argument("--from-samples", help="fit saved iterations instead of measuring")
    args = parser.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.from_samples:
        with open(args.from_samples, encoding="utf-8") as f:
            saved = json.load(f)
        x, y = np.array(saved["x"]), np.array(saved["y"])
        max_model_len, threads = saved["max_model_len"], saved["threads"]
    else:
        (x, y, max_model_len), threads = measure(args), torch.get_num_threads()
    if args.samples:
        with open(args.samples, "w", encoding="utf-8") as f:
            json.dump({"x": x.tolist(), "y": y.tolist(), "max_model_len": max_model_len, "threads": threads}, f)
    fit_err, test_err = held_out_errors(x, y)
    coef = fit(x, y)  # the shipped coefficients use every iteration
    print(f"iterations: {len(y)}; coefficients (s): " + ", ".join(f"{k}={v:.4g}" for k, v in zip(FEATURES, coef)))
    for name, err in (("fitted", fit_err), ("held-out", test_err)):
        print(f"error on {name} iterations: " + ", ".join(f"{k} {v:.3g}" for k, v in err.items()))
    note = (f"{platform.node()}: {os.cpu_count()} CPUs, torch threads {threads}, {len(y)} iterations of "
            f"{args.num_requests} orca-paper requests; held-out error: median {test_err['median_abs_pct']:.1f}% "
            f"per iteration, {test_err['total_time_pct']:+.1f}% on their total time, R^2 {test_err['r2']:.2f}")
    write_fitted(args.out, coef, max_model_len, args.kv_cache_tokens, note)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
