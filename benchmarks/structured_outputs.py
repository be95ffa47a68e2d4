"""The cost of constrained decoding, measured side by side in one run: offline throughput with half the
requests constrained by a JSON schema against the same workload with none constrained, and the
grammar compile time of each schema used.

The same tokens are generated both ways: a constrained warm-up run keeps each constrained request's
output length (greedy, so every constrained run repeats it); in the unconstrained runs those requests
generate exactly that many tokens (ignore_eos). So the ratio is the price of the grammars (mask, matcher,
scheduling) alone. After one warm-up run of each, `--repeats` pairs run, which of the two goes first
alternating; the median ratio is reported.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 \\
        python benchmarks/structured_outputs.py --model .cache/demo-llama --num-requests 64
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shared.env import prefer_passive_openmp  # noqa: E402

prefer_passive_openmp()  # as `orca generate` does, before torch is imported
import torch  # noqa: E402

from benchmarks.common import engine_parser, make_engine, write_summary  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from model.arch import eos_token_ids, load_arch_config  # noqa: E402
from model.structured import GrammarMatchers  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402
from shared.structured import StructuredOutputs  # noqa: E402

SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4}},
        "required": ["name", "age", "email", "tags"]},
    "order": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 10**6},
        "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
        "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "maxLength": 10}, "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
            "required": ["sku", "qty"]}}},
        "required": ["id", "status", "items"]},
    "event": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 24}, "day": {"type": "string", "pattern": "^2026-[01][0-9]-[0-3][0-9]$"},
        "attendees": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 5},
        "online": {"type": "boolean"}, "room": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 500},
                                                          {"type": "null"}]}},
        "required": ["title", "day", "attendees", "online", "room"]},
    "review": {"type": "object", "properties": {
        "stars": {"type": "integer", "minimum": 1, "maximum": 5}, "summary": {"type": "string", "maxLength": 40},
        "pros": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "cons": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
        "required": ["stars", "summary", "pros", "cons"]},
}


def workload(args: argparse.Namespace, vocab: int) -> list[dict]:
    rng = random.Random(args.seed)
    names = list(SCHEMAS)
    return [{"id": f"r{i}", "prompt": [rng.randrange(10, vocab) for _ in range(rng.randint(16, 96))],
             "max_tokens": rng.randint(64, 160), "schema": names[i // 2 % len(names)] if i % 2 == 0 else None}
            for i in range(args.num_requests)]


def run(engine: LLMEngine, requests: list[dict], constrained: bool, lengths: dict[str, int] | None) -> dict:
    """`lengths`: each constrained request's output length. Known, a constrained request's max_tokens is one
    more (its grammar still ends it): Orca reserves KV for prompt + max_tokens, so both runs admit alike."""
    for r in requests:
        if constrained and r["schema"]:
            max_tokens = lengths[r["id"]] + 1 if lengths else 400
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                    structured_outputs=StructuredOutputs(json=SCHEMAS[r["schema"]]))
        else:
            max_tokens = lengths[r["id"]] if lengths and r["schema"] else r["max_tokens"]
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(r["id"], r["prompt"], params)
    generated, out_lengths, valid = 0, {}, 0
    start = time.perf_counter()
    while engine.has_unfinished:
        for delta in engine.step():
            generated += len(delta.new_token_ids)
            if delta.finished:
                out_lengths[delta.completion.request_id] = len(delta.completion.token_ids)
                if constrained and delta.completion.request_id in SCHEMA_OF:
                    valid += _parses(delta.completion.text) and delta.completion.finish_reason.label == "stop"
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": generated, "tokens_per_s": generated / seconds, "lengths": out_lengths,
            "valid_json": valid}


SCHEMA_OF: dict[str, str] = {}
THREADS = torch.get_num_threads()


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except json.JSONDecodeError:
        return False


def compile_times(model: str) -> dict:
    arch = load_arch_config(model)
    grammars = GrammarMatchers(model, arch.vocab_size, eos_token_ids(model))
    start = time.perf_counter()
    grammars._llg_tokenizer()
    out = {"tokenizer_ms": 1e3 * (time.perf_counter() - start)}
    for name, schema in SCHEMAS.items():
        text = StructuredOutputs(json=schema).grammar_text()
        start = time.perf_counter()
        matcher = grammars._prototype(text).deep_copy()
        compiled = time.perf_counter()
        mask = torch.full((1, -(-arch.vocab_size // 32)), -1, dtype=torch.int32)
        from llguidance.torch import fill_next_token_bitmask

        fill_next_token_bitmask(matcher, mask, 0)
        out[name] = {"compile_ms": 1e3 * (compiled - start), "first_mask_ms": 1e3 * (time.perf_counter() - compiled)}
    return out


def main() -> None:
    parser = engine_parser(__doc__, num_requests=64, max_num_seqs=64, kv_cache_tokens=32768, dtype="auto")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", help="write the results as JSON here")
    args = parser.parse_args()
    arch = load_arch_config(args.model)
    requests = workload(args, arch.vocab_size)
    SCHEMA_OF.update({r["id"]: r["schema"] for r in requests if r["schema"]})
    engine = make_engine(args)
    lengths = run(engine, requests, True, None)["lengths"]  # warm-up: shapes, and the schemas compiled once
    run(engine, requests, False, lengths)
    pairs = []
    for repeat in range(args.repeats):
        if repeat % 2:
            plain = run(engine, requests, False, lengths)
            constrained = run(engine, requests, True, lengths)
        else:
            constrained = run(engine, requests, True, lengths)
            plain = run(engine, requests, False, lengths)
        assert plain["tokens"] == constrained["tokens"], "both runs generate the same tokens"
        pairs.append((constrained, plain))
        print(f"repeat {repeat}: half constrained {constrained['tokens_per_s']:.0f} tok/s, none constrained "
              f"{plain['tokens_per_s']:.0f} tok/s, ratio {constrained['tokens_per_s'] / plain['tokens_per_s']:.3f} "
              f"({constrained['tokens']} tokens each; {constrained['valid_json']}/{len(SCHEMA_OF)} outputs parse)",
              file=sys.stderr)
    ratios = [c["tokens_per_s"] / p["tokens_per_s"] for c, p in pairs]
    result = {
        "model": args.model, "vocab_size": arch.vocab_size, "num_requests": args.num_requests,
        "constrained_requests": len(SCHEMA_OF), "threads": THREADS,
        "tcmalloc": "tcmalloc" in os.environ.get("LD_PRELOAD", ""), "load_average": os.getloadavg(),
        "half_constrained_tokens_per_s": [c["tokens_per_s"] for c, _ in pairs],
        "none_constrained_tokens_per_s": [p["tokens_per_s"] for _, p in pairs],
        "ratio_median": statistics.median(ratios), "ratios": ratios,
        "valid_json": [c["valid_json"] for c, _ in pairs],
        "compile": compile_times(args.model),
    }
    write_summary(result, args.output)


if __name__ == "__main__":
    main()
