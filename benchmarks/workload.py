"""The Orca paper's workload shape: input lengths U[32,512], output lengths U[1,128], EOS ignored.

Random token ids (the demo models are random too); written as `orca generate` JSONL so every
engine in a side-by-side run reads the same file.
"""

from __future__ import annotations

import argparse
import json
import random


def orca_paper_workload(num_requests: int, seed: int = 0, vocab_size: int = 4096,
                        input_range: tuple[int, int] = (32, 512),
                        output_range: tuple[int, int] = (1, 128)) -> list[dict]:
    rng = random.Random(seed)
    requests = []
    for i in range(num_requests):
        prompt_len = rng.randint(*input_range)
        requests.append({
            "id": f"req-{i}",
            "prompt_token_ids": [rng.randrange(10, vocab_size) for _ in range(prompt_len)],
            "max_tokens": rng.randint(*output_range),
            "temperature": 0.0,
            "ignore_eos": True,
        })
    return requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    with open(args.output, "w") as f:
        for request in orca_paper_workload(args.num_requests, args.seed, args.vocab_size):
            f.write(json.dumps(request) + "\n")


if __name__ == "__main__":
    main()
