"""llguidance against xgrammar on one JSON schema, the measurement behind choosing llguidance
(benchmarks/README.md, "Structured outputs"): tokenizer set-up, grammar compile, mask time per token
while a greedy random "model" writes the JSON, and whether importing the library pulls in torch (the
control plane, which checks every grammar a user sends, must not import it).

xgrammar is not a dependency: `pip install xgrammar` first (it leaves the CPU torch in place).

    python benchmarks/grammar_libraries.py .cache/demo-llama .cache/demo-llama-small
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import torch

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                 "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
                "required": ["city"], "additionalProperties": False}},
    "required": ["name", "age", "address"], "additionalProperties": False}
MAX_TOKENS = 200


def imports_torch(module: str) -> bool:
    code = f"import sys, {module}; print('torch' in sys.modules)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "True"


def llguidance_run(tokenizer, vocab: int) -> dict:
    import llguidance
    import llguidance.hf
    from llguidance.torch import fill_next_token_bitmask

    start = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    setup = time.perf_counter() - start
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults={"whitespace_flexible": False})
    start = time.perf_counter()
    matcher = llguidance.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - start
    bitmask = torch.full((1, -(-vocab // 32)), -1, dtype=torch.int32)

    def step() -> bool:
        fill_next_token_bitmask(matcher, bitmask, 0)
        return bitmask

    def accept(token: int) -> bool:
        matcher.consume_token(token)
        return matcher.is_stopped()

    return {"setup_ms": 1e3 * setup, "compile_ms": 1e3 * compile_s, **generate(step, accept, vocab, tokenizer)}


def xgrammar_run(tokenizer, vocab: int) -> dict:
    import xgrammar

    start = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiler = xgrammar.GrammarCompiler(info)
    setup = time.perf_counter() - start
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    compile_s = time.perf_counter() - start
    matcher = xgrammar.GrammarMatcher(compiled)
    bitmask = xgrammar.allocate_token_bitmask(1, vocab)

    def step():
        matcher.fill_next_token_bitmask(bitmask, 0)
        return bitmask

    def accept(token: int) -> bool:
        matcher.accept_token(token)
        return matcher.is_terminated()

    return {"setup_ms": 1e3 * setup, "compile_ms": 1e3 * compile_s, **generate(step, accept, vocab, tokenizer)}


def generate(step, accept, vocab: int, tokenizer) -> dict:
    from model.structured import apply_token_bitmask

    generator = torch.Generator().manual_seed(0)
    mask_s, tokens = 0.0, []
    while len(tokens) < MAX_TOKENS:
        start = time.perf_counter()
        bitmask = step()
        mask_s += time.perf_counter() - start
        logits = torch.randn(1, vocab, generator=generator)
        apply_token_bitmask(logits, [0], bitmask)
        tokens.append(int(logits.argmax()))
        if accept(tokens[-1]):
            break
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    try:
        json.loads(text)
        valid = True
    except json.JSONDecodeError:
        valid = False
    return {"tokens": len(tokens), "mask_us_per_token": 1e6 * mask_s / len(tokens), "valid_json": valid}


def main() -> None:
    import argparse

    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", help="checkpoint directories (their tokenizer and config.json)")
    args = parser.parse_args()
    sys.path.insert(0, ".")
    results = {"imports_torch": {m: imports_torch(m) for m in ("llguidance", "xgrammar")}}
    for model in args.models:
        vocab = json.load(open(f"{model}/config.json"))["vocab_size"]
        tokenizer = AutoTokenizer.from_pretrained(model)
        results[model] = {"vocab": vocab, "llguidance": llguidance_run(tokenizer, vocab),
                          "xgrammar": xgrammar_run(tokenizer, vocab)}
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
