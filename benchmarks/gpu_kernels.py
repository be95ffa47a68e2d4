"""GPU check of kernels/: correctness of every Triton kernel, compiled for CUDA, against its torch
reference, then timings against torch (SDPA for attention, eager torch for the rest).

    python benchmarks/gpu_kernels.py --out results.json

Prints a summary table and writes every check and timing to JSON. Exits 0 only if every check passed.
Sized to finish in a few minutes on one H100/H200-class GPU.
"""

import argparse
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # so `kernels` imports from any working dir

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
LLAMA_8B = {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128}


@dataclass
class Check:
    name: str
    max_abs_err: float | None = None
    tol: float | None = None
    passed: bool = False
    error: str | None = None


@dataclass
class Timing:
    kernel: str
    case: str
    triton_ms: float | None = None
    torch_ms: dict[str, float] = field(default_factory=dict)  # baseline name -> ms
    bytes_moved: float | None = None
    flops: float | None = None
    error: str | None = None

    def speedup(self) -> float | None:
        if self.triton_ms is None or not self.torch_ms:
            return None
        return min(self.torch_ms.values()) / self.triton_ms


# ---- inputs -----------------------------------------------------------------------------------------


@dataclass
class AttentionCase:
    requests: list[tuple[int, int]]  # (q_len, seq_len)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    scattered: bool

    def describe(self) -> str:
        n_dec = sum(q == 1 for q, _ in self.requests)
        layout = "paged" if self.scattered else "contig"
        return (
            f"B={len(self.requests)} dec={n_dec} T={sum(q for q, _ in self.requests)} "
            f"ctx<={max(c for _, c in self.requests)} h={self.num_heads}/{self.num_kv_heads} d={self.head_dim} "
            f"bs={self.block_size} {layout} {str(self.dtype).removeprefix('torch.')}"
        )

    def attended_pairs(self) -> int:
        return sum(q * (c - q) + q * (q + 1) // 2 for q, c in self.requests)

    def kv_bytes(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return sum(c for _, c in self.requests) * self.num_kv_heads * self.head_dim * 2 * elem


def make_attention_inputs(case: AttentionCase, seed: int = 0) -> tuple:
    """Random cache with NaN in every slot no request owns (a stray read poisons the output)."""
    gen = torch.Generator().manual_seed(seed)
    bs, nkv, hd = case.block_size, case.num_kv_heads, case.head_dim
    needed = [math.ceil(c / bs) for _, c in case.requests]
    num_blocks = sum(needed) + 1  # the last block is never owned: table padding points at it
    order = torch.randperm(num_blocks - 1, generator=gen) if case.scattered else torch.arange(num_blocks - 1)
    tables = torch.full((len(case.requests), max(needed) + 1), num_blocks - 1, dtype=torch.int32)
    slots, used = [], 0
    for i, ((_, ctx), n) in enumerate(zip(case.requests, needed)):
        tables[i, :n] = order[used : used + n]
        used += n
        pos = torch.arange(ctx)
        slots.append(tables[i, pos // bs].long() * bs + pos % bs)
    all_slots = torch.cat(slots).cuda()
    k_cache = torch.full((num_blocks, bs, nkv, hd), float("nan"), dtype=case.dtype, device="cuda")
    v_cache = torch.full_like(k_cache, float("nan"))
    k_cache.view(-1, nkv, hd)[all_slots] = torch.randn(len(all_slots), nkv, hd, device="cuda").to(case.dtype)
    v_cache.view(-1, nkv, hd)[all_slots] = torch.randn(len(all_slots), nkv, hd, device="cuda").to(case.dtype)
    q_lens = [q for q, _ in case.requests]
    qsl = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32).cuda()
    query = torch.randn(sum(q_lens), case.num_heads, hd, device="cuda").to(case.dtype)
    seq_lens = torch.tensor([c for _, c in case.requests], dtype=torch.int32).cuda()
    return query, k_cache, v_cache, tables.cuda(), seq_lens, qsl, hd**-0.5


def padded_decode_sdpa(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale):
    """Baseline for decode-only batches: gather every request's K/V into one padded batch, one SDPA call."""
    bs, nkv, hd = k_cache.shape[1:]
    max_ctx = int(seq_lens.max())
    pos = torch.arange(max_ctx, device=query.device)
    valid = pos[None, :] < seq_lens[:, None]  # (B, S)
    col = (pos // bs).clamp(max=block_tables.shape[1] - 1).expand(len(seq_lens), -1)
    slots = torch.where(valid, block_tables.gather(1, col).long() * bs + pos % bs, 0)  # (B, S)
    k = k_cache.view(-1, nkv, hd)[slots].transpose(1, 2)  # (B, nkv, S, hd)
    v = v_cache.view(-1, nkv, hd)[slots].transpose(1, 2)
    out = F.scaled_dot_product_attention(
        query[:, :, None], k, v, attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=True
    )  # (B, nh, 1, hd)
    return out.squeeze(2)


# ---- correctness -----------------------------------------------------------------------------------


def _compare(name: str, actual: torch.Tensor, expected: torch.Tensor, tol: float) -> Check:
    err = (actual.float() - expected.float()).abs()
    max_err = float(err.max()) if err.numel() else 0.0
    finite = bool(torch.isfinite(actual.float()).all())
    ok = finite and bool((err <= tol + tol * expected.float().abs()).all())
    return Check(name, max_err if finite else float("nan"), tol, ok)


def check_attention(cases: list[AttentionCase]) -> list[Check]:
    from orca_kernels.attention import attention_dense_reference, ragged_attention_torch, ragged_attention_triton

    checks = []
    for case in cases:
        args = make_attention_inputs(case)
        expected = attention_dense_reference(*args)
        tol = TOL[case.dtype]
        checks.append(_compare(f"attention triton {case.describe()}", ragged_attention_triton(*args), expected, tol))
        checks.append(_compare(f"attention torch  {case.describe()}", ragged_attention_torch(*args), expected, tol))
    return checks


def check_pointwise() -> list[Check]:
    from orca_kernels import activations, kv_cache, norms, rotary

    checks = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        tol, tag = TOL[dtype], str(dtype).removeprefix("torch.")
        x, r = (torch.randn(37, 4096, device="cuda").to(dtype) for _ in range(2))
        w, b = (torch.randn(4096, device="cuda").to(dtype) for _ in range(2))
        for res in (None, r):
            suffix = f"{tag} residual={res is not None}"
            got, want = norms.rms_norm_triton(x, w, 1e-6, res), norms.rms_norm_torch(x, w, 1e-6, res)
            checks.append(_compare(f"rms_norm {suffix}", got[0], want[0], tol))
            checks.append(_compare(f"rms_norm sum {suffix}", got[1], want[1], tol))
            got, want = norms.layer_norm_triton(x, w, b, 1e-5, res), norms.layer_norm_torch(x, w, b, 1e-5, res)
            checks += [_compare(f"layer_norm {suffix}", got[0], want[0], tol)]
        gate_up = torch.randn(37, 2 * 11008, device="cuda").to(dtype) * 3
        silu_ref = activations.silu_and_mul_torch(gate_up)
        checks.append(_compare(f"silu_and_mul {tag}", activations.silu_and_mul_triton(gate_up), silu_ref, tol))
        # 16-bit eager torch rounds after every op (1 + tanh cancels): compare to fp32 math rounded once.
        gelu_ref = activations.gelu_tanh_torch(gate_up.float()).to(dtype)
        checks.append(_compare(f"gelu_tanh {tag}", activations.gelu_tanh_triton(gate_up), gelu_ref, tol))
        for hd in (64, 80, 128):
            qkv = torch.randn(37, 32 + 16, hd, device="cuda").to(dtype)
            angles = torch.arange(4096, device="cuda")[:, None] * torch.rand(hd // 2, device="cuda")[None, :]
            positions = torch.randint(0, 4096, (37,), device="cuda")
            cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
            ref = qkv.float()  # fp32 math rounded once, as the kernel does (x1*c - x2*s cancels in 16 bits)
            rotary.apply_rotary_torch(ref[:, :32], ref[:, 32:40], cos.float(), sin.float(), positions)
            rotary.apply_rotary_triton(qkv[:, :32], qkv[:, 32:40], cos, sin, positions)
            checks.append(_compare(f"rotary {tag} hd={hd}", qkv, ref.to(dtype), tol))
            caches = [torch.zeros(64, 16, 8, hd, device="cuda", dtype=dtype) for _ in range(4)]
            slots = torch.randperm(64 * 16, device="cuda")[:37]
            kv_cache.write_kv_torch(qkv[:, 32:40], qkv[:, 40:], caches[0], caches[1], slots)
            kv_cache.write_kv_triton(qkv[:, 32:40], qkv[:, 40:], caches[2], caches[3], slots)
            checks.append(_compare(f"write_kv {tag} hd={hd}", torch.stack(caches[2:]), torch.stack(caches[:2]), 0.0))
    return checks


def correctness_cases() -> list[AttentionCase]:
    mixed = [(1, 1), (7, 7), (5, 23), (1, 70), (18, 75), (1, 17), (130, 130), (64, 300), (1, 1000)]
    cases = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for nh, nkv in ((32, 8), (16, 16), (8, 1), (12, 4)):
            for hd in (64, 80, 128):
                cases.append(AttentionCase(mixed, nh, nkv, hd, 16, dtype, scattered=(nh + hd) % 3 != 0))
        cases.append(AttentionCase(mixed, 8, 2, 256, 16, dtype, True))
        cases.append(AttentionCase(mixed, 8, 2, 96, 1, dtype, True))
        cases.append(AttentionCase([(1, c) for c in range(1, 600, 37)], 32, 8, 128, 16, dtype, False))
    big = [(1024, 4096), (512, 512)] + [(1, 1000 + 97 * i) for i in range(64)]
    cases.append(AttentionCase(big, **LLAMA_8B, block_size=16, dtype=torch.bfloat16, scattered=True))
    return cases


# ---- timing ----------------------------------------------------------------------------------------


def _bench(fn: Callable[[], object]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def bench_attention() -> list[Timing]:
    from orca_kernels.attention import ragged_attention_torch, ragged_attention_triton

    scenarios = {
        "decode B=64 ctx=2048": [(1, 2048)] * 64,
        "decode B=256 ctx=512": [(1, 512)] * 256,
        "decode B=4 ctx=16384": [(1, 16384)] * 4,
        "prefill 4x2048": [(2048, 2048)] * 4,
        "chunk 1024 after 3072 + 128 dec": [(1024, 4096)] + [(1, 1024 + 24 * i) for i in range(128)],
    }
    timings = []
    for label, reqs in scenarios.items():
        for scattered in (True, False) if label.startswith("decode B=64") else (True,):
            case = AttentionCase(reqs, **LLAMA_8B, block_size=16, dtype=torch.bfloat16, scattered=scattered)
            t = Timing("attention", f"{label} {'paged' if scattered else 'contig'} bf16")
            try:
                args = make_attention_inputs(case)
                max_q = max(q for q, _ in reqs)
                t.triton_ms = _bench(lambda: ragged_attention_triton(*args, max_query_len=max_q))
                t.torch_ms["sdpa loop"] = _bench(lambda: ragged_attention_torch(*args))
                if max_q == 1:
                    t.torch_ms["sdpa padded"] = _bench(lambda: padded_decode_sdpa(*args))
                t.bytes_moved, t.flops = case.kv_bytes(), 4.0 * case.attended_pairs() * case.num_heads * case.head_dim
            except Exception:
                t.error = traceback.format_exc()
            timings.append(t)
    return timings


def bench_pointwise() -> list[Timing]:
    from orca_kernels import activations, kv_cache, norms, rotary

    dt, T = torch.bfloat16, 8192
    x, r = (torch.randn(T, 4096, device="cuda", dtype=dt) for _ in range(2))
    w, b = (torch.randn(4096, device="cuda", dtype=dt) for _ in range(2))
    gate_up = torch.randn(T, 2 * 14336, device="cuda", dtype=dt)
    h_gelu = torch.randn(T, 4 * 1600, device="cuda", dtype=dt)
    qkv = torch.randn(T, 48, 128, device="cuda", dtype=dt)
    cos, sin = (torch.rand(8192, 64, device="cuda", dtype=dt) for _ in range(2))
    positions = torch.randint(0, 8192, (T,), device="cuda")
    k_cache, v_cache = (torch.zeros(T // 16 + 1, 16, 8, 128, device="cuda", dtype=dt) for _ in range(2))
    slots = torch.randperm(T, device="cuda")
    q, k, v = qkv[:, :32], qkv[:, 32:40], qkv[:, 40:]  # strided views, as the runner passes them
    e = 2  # bytes per bf16 element
    cases = [  # (kernel, case, triton fn, torch fn, args, minimum bytes moved)
        ("rms_norm", "T=8192 H=4096 +residual", norms.rms_norm_triton, norms.rms_norm_torch,
         (x, w, 1e-6, r), 4 * T * 4096 * e),
        ("layer_norm", "T=8192 H=4096 +residual", norms.layer_norm_triton, norms.layer_norm_torch,
         (x, w, b, 1e-5, r), 4 * T * 4096 * e),
        ("silu_and_mul", "T=8192 I=14336", activations.silu_and_mul_triton, activations.silu_and_mul_torch,
         (gate_up,), 3 * T * 14336 * e),
        ("gelu_tanh", "T=8192 N=6400", activations.gelu_tanh_triton, activations.gelu_tanh_torch,
         (h_gelu,), 2 * T * 6400 * e),
        ("apply_rotary", "T=8192 h=32/8 d=128 qkv view", rotary.apply_rotary_triton, rotary.apply_rotary_torch,
         (q, k, cos, sin, positions), 2 * T * 40 * 128 * e),
        ("write_kv", "T=8192 kv=8 d=128", kv_cache.write_kv_triton, kv_cache.write_kv_torch,
         (k, v, k_cache, v_cache, slots), 4 * T * 8 * 128 * e),
    ]  # fmt: skip
    timings = []
    for kernel, label, triton_fn, torch_fn, fn_args, nbytes in cases:
        t = Timing(kernel, f"{label} bf16", bytes_moved=nbytes)
        try:
            t.triton_ms = _bench(lambda: triton_fn(*fn_args))
            t.torch_ms["eager"] = _bench(lambda: torch_fn(*fn_args))
        except Exception:
            t.error = traceback.format_exc()
        timings.append(t)
    return timings


# ---- report ----------------------------------------------------------------------------------------


def print_report(checks: list[Check], timings: list[Timing]) -> None:
    failed = [c for c in checks if not c.passed]
    print(f"\ncorrectness: {len(checks) - len(failed)}/{len(checks)} passed")
    for c in failed:
        print(f"  FAIL {c.name}: max_abs_err={c.max_abs_err} tol={c.tol} {c.error or ''}")
    header = f"{'kernel':<13} {'case':<45} {'triton ms':>10} {'torch ms (best)':>24} {'x':>6}"
    header += f" {'GB/s':>7} {'TFLOP/s':>8}"
    print(f"\n{header}")
    for t in timings:
        if t.error:
            print(f"{t.kernel:<13} {t.case:<45} ERROR {t.error.strip().splitlines()[-1]}")
            continue
        best = min(t.torch_ms, key=t.torch_ms.get)
        gbs = t.bytes_moved / t.triton_ms / 1e6 if t.bytes_moved else float("nan")
        tflops = t.flops / t.triton_ms / 1e9 if t.flops else float("nan")
        torch_col = f"{t.torch_ms[best]:.3f} ({best})"
        print(
            f"{t.kernel:<13} {t.case:<45} {t.triton_ms:>10.3f} {torch_col:>24} {t.speedup():>6.2f} "
            f"{gbs:>7.0f} {tflops:>8.1f}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results.json"), help="where to write the JSON results")
    parser.add_argument("--checks-only", action="store_true", help="skip the timings")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_kernels.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing ran.", file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: this script checks compiled kernels, not the interpreter.", file=sys.stderr)
        return 2
    try:
        import triton
    except ImportError:
        print("gpu_kernels.py needs triton, which is not installed.", file=sys.stderr)
        return 2

    started = time.perf_counter()
    checks: list[Check] = []
    for name, run in (("attention", lambda: check_attention(correctness_cases())), ("pointwise", check_pointwise)):
        try:
            checks += run()
        except Exception:
            checks.append(Check(f"{name} checks crashed", error=traceback.format_exc()))
        print(f"[{time.perf_counter() - started:6.1f}s] {name} checks done", flush=True)
    timings: list[Timing] = []
    if not args.checks_only:
        for name, run in (("attention", bench_attention), ("pointwise", bench_pointwise)):
            try:
                timings += run()
            except Exception:
                timings.append(Timing(name, "all", error=traceback.format_exc()))
            print(f"[{time.perf_counter() - started:6.1f}s] {name} timings done", flush=True)
    print_report(checks, timings)
    all_passed = all(c.passed for c in checks)
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "seconds": time.perf_counter() - started,
        "all_passed": all_passed,
        "checks": [asdict(c) for c in checks],
        "timings": [{**asdict(t), "speedup": t.speedup()} for t in timings],
    }
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")
    return 0 if all_passed else 1


if __name__ == "__main__":
    sys.exit(main())
