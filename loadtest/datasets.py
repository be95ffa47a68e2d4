"""Benchmark workloads: lists of `GenerateRequest`, the body every transport sends.

- `orca-paper`: the Orca paper's trace shape (OSDI '22, section 6): input lengths U[32,512],
  output lengths U[1,128], EOS ignored, so every request generates exactly `max_tokens`.
- `random`: the same with the given ranges.
- `jsonl`: a file of prompts in the `orca generate` input format (one JSON object a line).
- a trace (JSONL of `arrival_s`, `prompt_len`, `output_len`), for `orca simulate --trace`.

Prompts of the synthetic datasets are random token ids (the demo models have random weights
too). Lengths and tokens come from their own seeded stream, so a sweep over request rates
replays the very same requests at each rate.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import numpy as np

from shared.api import GenerateRequest, decode_generate_request

ORCA_PAPER_INPUT = (32, 512)
ORCA_PAPER_OUTPUT = (1, 128)
FIRST_TOKEN_ID = 10
"""Random prompts avoid the lowest ids, where the demo tokenizer keeps its special tokens."""
DATASETS = ("orca-paper", "random", "jsonl")


def parse_range(text: str) -> tuple[int, int]:
    """'N' or 'LO:HI' (inclusive) -> (lo, hi); ValueError names the bad value."""
    parts = text.split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[0])) if len(parts) == 1 else (int(parts[0]), int(parts[1]))
    except (ValueError, IndexError):
        raise ValueError(f"length range {text!r} must be N or LO:HI") from None
    if len(parts) > 2 or lo < 1 or hi < lo:
        raise ValueError(f"length range {text!r} must be N or LO:HI with 1 <= LO <= HI")
    return lo, hi


def random_requests(num_prompts: int, input_range: tuple[int, int], output_range: tuple[int, int], *,
                    seed: int = 0, vocab_size: int = 4096, prefix: str = "req") -> list[GenerateRequest]:
    """Random token prompts with lengths uniform in the inclusive ranges; greedy, EOS ignored."""
    if vocab_size <= FIRST_TOKEN_ID:
        raise ValueError(f"vocab_size={vocab_size} must be above {FIRST_TOKEN_ID}")
    rng = np.random.default_rng([seed, 0])
    prompt_lens = rng.integers(input_range[0], input_range[1] + 1, size=num_prompts)
    output_lens = rng.integers(output_range[0], output_range[1] + 1, size=num_prompts)
    tokens = rng.integers(FIRST_TOKEN_ID, vocab_size, size=int(prompt_lens.sum())).tolist()
    requests, start = [], 0
    for i, (prompt_len, output_len) in enumerate(zip(prompt_lens.tolist(), output_lens.tolist())):
        requests.append(GenerateRequest(
            id=f"{prefix}-{i}", prompt_token_ids=tokens[start:start + prompt_len], max_tokens=output_len,
            temperature=0.0, ignore_eos=True))
        start += prompt_len
    return requests


def orca_paper_requests(num_prompts: int, *, seed: int = 0, vocab_size: int = 4096) -> list[GenerateRequest]:
    return random_requests(num_prompts, ORCA_PAPER_INPUT, ORCA_PAPER_OUTPUT, seed=seed, vocab_size=vocab_size)


def _open_text(path: str | Path, flag: str):
    """A workload file, or a ValueError that names the flag and why (the CLIs print it as one line)."""
    try:
        return open(path, encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"{flag} {path}: {exc.strerror or exc}") from None


def jsonl_requests(path: str | Path, num_prompts: int | None = None) -> list[GenerateRequest]:
    """The first `num_prompts` requests of an `orca generate` input file (all when None)."""
    requests = []
    with _open_text(path, "--dataset-path") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            if num_prompts is not None and len(requests) >= num_prompts:
                break
            try:
                requests.append(decode_generate_request(line))
            except ValueError as exc:
                raise ValueError(f"{path} line {lineno}: {exc}") from None
    if not requests:
        raise ValueError(f"{path} holds no requests")
    return requests


def load_dataset(name: str, num_prompts: int, *, seed: int = 0, vocab_size: int = 4096, path: str | None = None,
                 input_range: tuple[int, int] = ORCA_PAPER_INPUT,
                 output_range: tuple[int, int] = ORCA_PAPER_OUTPUT) -> list[GenerateRequest]:
    if name == "orca-paper":
        return orca_paper_requests(num_prompts, seed=seed, vocab_size=vocab_size)
    if name == "random":
        return random_requests(num_prompts, input_range, output_range, seed=seed, vocab_size=vocab_size)
    if name == "jsonl":
        if not path:
            raise ValueError("--dataset jsonl needs --dataset-path FILE")
        return jsonl_requests(path, num_prompts)
    raise ValueError(f"dataset {name!r} is not one of {DATASETS}")


def prompt_len(request: GenerateRequest) -> int | None:
    """Prompt length in tokens when the request gives token ids (None for text and chat)."""
    return len(request.prompt_token_ids) if request.prompt_token_ids is not None else None


def with_token_ids(requests: list[GenerateRequest], model: str | None) -> list[GenerateRequest]:
    """Requests with prompt_token_ids: text and chat prompts tokenized with `model`'s tokenizer
    (the simulator counts tokens and has no model of its own)."""
    if all(r.prompt_token_ids is not None for r in requests):
        return requests
    if model is None:
        raise ValueError("these prompts are text: give --model DIR (its tokenizer counts their tokens)")
    from engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model)
    if tokenizer is None:
        raise ValueError(f"{model} has no tokenizer")
    out = []
    for r in requests:
        ids = r.prompt_token_ids
        if ids is None:
            ids = (tokenizer.apply_chat_template([msgspec.structs.asdict(m) for m in r.messages]) if r.messages
                   else tokenizer.encode(r.prompt))
        out.append(msgspec.structs.replace(r, prompt=None, messages=None, prompt_token_ids=ids))
    return out


def load_trace(path: str | Path, *, vocab_size: int = 4096, seed: int = 0) -> tuple[list[GenerateRequest], list[float]]:
    """A trace file: JSONL lines `{"arrival_s": float, "prompt_len": int, "output_len": int}`.

    Returns the requests (random prompts of those lengths, EOS ignored) and their arrival
    times, sorted by arrival."""
    rows = []
    with _open_text(path, "--trace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                arrival, plen, olen = float(row["arrival_s"]), int(row["prompt_len"]), int(row["output_len"])
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path} line {lineno}: need arrival_s, prompt_len, output_len ({exc})") from None
            if arrival < 0 or plen < 1 or olen < 1:
                raise ValueError(f"{path} line {lineno}: arrival_s >= 0, prompt_len >= 1, output_len >= 1")
            rows.append((arrival, plen, olen))
    if not rows:
        raise ValueError(f"{path} holds no requests")
    rows.sort(key=lambda r: r[0])
    rng = np.random.default_rng([seed, 2])
    requests = [GenerateRequest(id=f"trace-{i}", max_tokens=olen, temperature=0.0, ignore_eos=True,
                                prompt_token_ids=rng.integers(FIRST_TOKEN_ID, vocab_size, plen).tolist())
                for i, (_, plen, olen) in enumerate(rows)]
    return requests, [r[0] for r in rows]
