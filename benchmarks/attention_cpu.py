"""The CPU attention kernel (kernels/orca_kernels/csrc/ragged_attention.c) alone, on batches shaped like serving's.

Each case builds four layers' K/V caches (blocks scattered at random, as a long-running cache's are) and
calls the kernel on them in turn, so every call reads its cache from memory as a model step does, not
from the last call's cache lines. Prints the best of `--repeats` means, in ms per call, for the C
kernel and for the torch path it replaced (`orca_kernels.attention.ragged_attention_torch`), and the
largest difference between the two:

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 python benchmarks/attention_cpu.py

The default shape is the tiny demo Llama's (4 heads of 64, 2 KV heads, blocks of 16), one thread as
`orca serve`'s worker runs.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from orca_kernels.attention import ragged_attention_torch  # noqa: E402
from orca_kernels.attention_cpu import ragged_attention_cpu  # noqa: E402

LAYERS = 4


def make_batch(q_lens: list[int], seq_lens: list[int], heads: int, kv_heads: int, head_dim: int,
               block_size: int) -> tuple:
    blocks_per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 8
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim)
    order = torch.randperm(num_blocks).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = order[used:used + n]
        used += n
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(sum(q_lens), heads, head_dim)
    return query, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32), starts


def cases(rng: random.Random) -> dict[str, tuple[list[int], list[int]]]:
    """(query lengths, context lengths) per request: decode batches, prompts, and a mix."""
    return {
        "decode x128, contexts 16-512": ([1] * 128, [rng.randint(16, 512) for _ in range(128)]),
        "decode x32, contexts 16-512": ([1] * 32, [rng.randint(16, 512) for _ in range(32)]),
        "prompts 4 x 200": ([200] * 4, [200] * 4),
        "decode x100 + prompts 150, 60": ([1] * 100 + [150, 60], [rng.randint(16, 512) for _ in range(100)] + [150, 60]),
    }


def time_calls(function, layers: list[tuple], calls: int, repeats: int, scale: float) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(calls):
            function(*layers[i % LAYERS], scale)
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calls", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--skip-torch", action="store_true", help="time the C kernel only")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    scale = args.head_dim ** -0.5
    print(f"{args.heads} heads of {args.head_dim}, {args.kv_heads} KV heads, blocks of {args.block_size}, "
          f"{args.threads} thread(s), load average {os.getloadavg()[0]:.2f}")
    print(f"| batch | C kernel ms | torch ms | max abs difference |\n|---|---:|---:|---:|")
    for name, (q_lens, seq_lens) in cases(random.Random(0)).items():
        layers = [make_batch(q_lens, seq_lens, args.heads, args.kv_heads, args.head_dim, args.block_size)
                  for _ in range(LAYERS)]
        difference = (ragged_attention_cpu(*layers[0], scale) - ragged_attention_torch(*layers[0], scale)).abs().max()
        c_ms = time_calls(ragged_attention_cpu, layers, args.calls, args.repeats, scale)
        torch_ms = "-" if args.skip_torch else f"{time_calls(ragged_attention_torch, layers, 4, 2, scale):.2f}"
        print(f"| {name} | {c_ms:.2f} | {torch_ms} | {difference.item():.1e} |", flush=True)


if __name__ == "__main__":
    main()
