"""Ragged (varlen) causal attention over a paged KV cache: one call per layer per iteration.

Selective batching concatenates the query tokens of every request in the iteration into `query`
`(T, nh, hd)`; `query_start_loc` cuts it into requests. Request i has `q_len_i` tokens at positions
`seq_lens[i] - q_len_i ... seq_lens[i] - 1`, whose K/V are already in the cache (`write_kv` ran first),
and each token attends to every cached position up to its own. This covers whole prompts, prompt chunks
with earlier context, and decodes (`q_len_i == 1`) in the same call. Query head h reads kv head
`h // (nh // nkv)` (GQA/MQA). Position p of request i lives in slot
`block_tables[i, p // block_size] * block_size + p % block_size`.
"""

import torch
import torch.nn.functional as F

try:  # Triton is optional: the torch path must import on machines without it.
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def _check_attention_args(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> None:
    if query.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"bad shapes: query {tuple(query.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
        )
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"query heads/dim {num_heads}/{head_dim} do not fit cache heads/dim {num_kv_heads}/{k_cache.shape[3]}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if query.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"query dtype {query.dtype} does not match cache dtypes {k_cache.dtype}, {v_cache.dtype}")
    num_seqs = seq_lens.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)}, seq_lens {tuple(seq_lens.shape)} and "
            f"query_start_loc {tuple(query_start_loc.shape)} disagree on the number of requests"
        )
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")


# ----------------------------------------------------------------------------------------------------
# Ground truth for tests: gather, full softmax in float32 (float64 for float64 input), explicit mask.


def attention_dense_reference(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                              scale: float) -> torch.Tensor:
    """Naive and slow on purpose: the definition the fast paths are tested against. Arguments and
    result as `ragged_attention_torch`'s."""
    _check_attention_args(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    acc_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    group = query.shape[1] // num_kv_heads
    out = torch.empty_like(query)
    for i in range(seq_lens.shape[0]):
        start, end, ctx = int(query_start_loc[i]), int(query_start_loc[i + 1]), int(seq_lens[i])
        pos = torch.arange(ctx, device=query.device)  # (ctx,)
        slots = block_tables[i, pos // block_size].long() * block_size + pos % block_size  # (ctx,)
        k = k_cache.reshape(-1, num_kv_heads, head_dim)[slots].to(acc_dtype).repeat_interleave(group, dim=1)
        v = v_cache.reshape(-1, num_kv_heads, head_dim)[slots].to(acc_dtype).repeat_interleave(group, dim=1)
        q = query[start:end].to(acc_dtype)  # (L, nh, hd)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # (nh, L, ctx)
        q_pos = torch.arange(ctx - (end - start), ctx, device=query.device)  # (L,)
        scores = scores.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v).to(query.dtype)
    return out


# ----------------------------------------------------------------------------------------------------
# Torch path (reference for the Triton kernel, and the production path on CPU): one SDPA call per request.


def _request_table(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, block_size: int
) -> list[tuple[int, int, int, int, bool]]:
    """Per request (start, end, ctx, first_block, blocks_are_consecutive), with one device->host copy."""
    num_blocks = (seq_lens + block_size - 1) // block_size  # (B,)
    cols = torch.arange(1, block_tables.shape[1], device=block_tables.device)  # (max_blocks - 1,)
    steps = block_tables[:, 1:] - block_tables[:, :-1] == 1  # (B, max_blocks - 1)
    consecutive = (steps | (cols[None, :] >= num_blocks[:, None])).all(dim=1)  # only the needed prefix counts
    rows = torch.stack(
        [query_start_loc[:-1], query_start_loc[1:], seq_lens, block_tables[:, 0], consecutive.to(torch.int32)]
    ).tolist()
    return [(s, e, c, b, bool(f)) for s, e, c, b, f in zip(*rows)]


def _request_kv(
    cache: torch.Tensor,  # (num_blocks, block_size, nkv, hd)
    block_row: torch.Tensor,  # (max_blocks,) int32, this request's block table
    ctx: int,
    first_block: int,
    consecutive: bool,
) -> torch.Tensor:  # (nkv, ctx, hd), a view when the blocks are consecutive
    block_size = cache.shape[1]
    slots = cache.view(-1, *cache.shape[2:])  # (num_slots, nkv, hd)
    if consecutive:  # Orca-style contiguous reservation: no copy at all.
        kv = slots[first_block * block_size : first_block * block_size + ctx]
    else:
        kv = cache.index_select(0, block_row[: -(-ctx // block_size)]).flatten(0, 1)[:ctx]
    return kv.transpose(0, 1)


_HALF = (torch.float16, torch.bfloat16)


def _attend_one(
    q: torch.Tensor,  # (L, nh, hd)
    k: torch.Tensor,  # (nkv, ctx, hd)
    v: torch.Tensor,  # (nkv, ctx, hd)
    scale: float,
) -> torch.Tensor:  # (L, nh, hd)
    q_len, num_heads, head_dim = q.shape
    num_kv_heads, ctx = k.shape[:2]
    if q_len == ctx:
        mask, is_causal = None, True
    else:
        # SDPA's is_causal aligns top-left; with earlier context the diagonal shifts right by ctx - L.
        mask = torch.ones(q_len, ctx, dtype=torch.bool, device=q.device).tril(diagonal=ctx - q_len)  # (L, ctx)
        is_causal = False
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1), k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=num_heads != num_kv_heads
    )  # (nh, L, hd)
    return o.transpose(0, 1)


def ragged_attention_torch(
    query: torch.Tensor,  # (T, nh, hd)
    k_cache: torch.Tensor,  # (num_blocks, block_size, nkv, hd)
    v_cache: torch.Tensor,  # (num_blocks, block_size, nkv, hd)
    block_tables: torch.Tensor,  # (B, max_blocks) int32
    seq_lens: torch.Tensor,  # (B,) int32, context length including this iteration's tokens
    query_start_loc: torch.Tensor,  # (B + 1,) int32
    scale: float,
    *,
    max_query_len: int | None = None,  # hints every attention path accepts; this one needs neither
    max_seq_len: int | None = None,
) -> torch.Tensor:  # (T, nh, hd)
    """Fast torch path: decodes in one tight loop of two bmm calls each, other requests one SDPA call each;
    K/V are views of the cache when a request's blocks are consecutive, a gather otherwise.

    A loop beats one padded SDPA over all decodes on CPU: the padded K/V gather costs more than it saves,
    so what is left to win is per-call overhead, which the decode loop keeps to a minimum.
    """
    _check_attention_args(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    out = torch.empty_like(query)
    if seq_lens.shape[0] == 0:
        return out
    requests = _request_table(block_tables, seq_lens, query_start_loc, k_cache.shape[1])
    decodes = [i for i, r in enumerate(requests) if r[1] - r[0] == 1]
    if decodes:
        rows = torch.tensor([requests[i][0] for i in decodes], device=query.device)
        out.index_copy_(0, rows, _decode_attention(query.index_select(0, rows), k_cache, v_cache, block_tables,
                                                   [(i, *requests[i][2:]) for i in decodes], scale))
    for i, (start, end, ctx, first_block, consecutive) in enumerate(requests):
        if end - start == 1:
            continue
        k = _request_kv(k_cache, block_tables[i], ctx, first_block, consecutive)  # (nkv, ctx, hd)
        v = _request_kv(v_cache, block_tables[i], ctx, first_block, consecutive)  # (nkv, ctx, hd)
        out[start:end] = _attend_one(query[start:end], k, v, scale)
    return out


def _decode_attention(
    query: torch.Tensor,  # (n, nh, hd), one query row per decoding request
    k_cache: torch.Tensor,  # (num_blocks, block_size, nkv, hd)
    v_cache: torch.Tensor,  # (num_blocks, block_size, nkv, hd)
    block_tables: torch.Tensor,  # (B, max_blocks) int32
    decodes: list[tuple[int, int, int, bool]],  # (row in block_tables, ctx, first_block, consecutive) per query
    scale: float,
) -> torch.Tensor:  # (n, nh, hd)
    n, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    upcast = query.dtype in _HALF
    # GQA: each kv head's query group is the M dim of one bmm, so K/V are never expanded.
    queries = (query * scale).view(n, num_kv_heads, group, head_dim).unbind(0)
    block_size = k_cache.shape[1]
    k_slots = k_cache.view(-1, num_kv_heads, head_dim)  # (num_slots, nkv, hd)
    v_slots = v_cache.view(-1, num_kv_heads, head_dim)
    outs = []
    for q, (row, ctx, first_block, consecutive) in zip(queries, decodes):
        if consecutive:  # views: no copy
            base = first_block * block_size
            k, v = k_slots[base:base + ctx], v_slots[base:base + ctx]  # (ctx, nkv, hd)
        else:
            k = _request_kv(k_cache, block_tables[row], ctx, first_block, False).transpose(0, 1)
            v = _request_kv(v_cache, block_tables[row], ctx, first_block, False).transpose(0, 1)
        scores = torch.bmm(q, k.permute(1, 2, 0))  # (nkv, group, ctx)
        probs = torch.softmax(scores.float(), dim=-1).to(v.dtype) if upcast else torch.softmax(scores, dim=-1)
        outs.append(torch.bmm(probs, v.transpose(0, 1)))  # (nkv, group, hd)
    return torch.stack(outs).view(n, num_heads, head_dim)


# ----------------------------------------------------------------------------------------------------
# Triton path: one kernel for prefill chunks and decodes together (FlashAttention-2 style online softmax).

if triton is not None:

    @triton.jit
    def _find_request(
        query_start_loc_ptr,  # (B + 1,) int32
        q_block,  # this program's index into the virtual list of query blocks
        num_seqs,  # B
        BLOCK_Q: tl.constexpr,  # query tokens per program
    ):
        # Request i owns virtual query blocks from query_start_loc[i] // BLOCK_Q + i on (an upper bound
        # on its real first block), so a binary search finds the request without any host-side table.
        lo: tl.int32 = 0
        hi = num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= q_block:
                lo = mid + 1
            else:
                hi = mid
        return lo - 1

    @triton.jit
    def _ragged_attention_kernel(
        out_ptr,  # (T, nh, hd) contiguous output
        q_ptr,  # (T, nh, hd) queries, any token/head strides, unit dim stride
        k_cache_ptr,  # (num_blocks * block_size, nkv, hd) contiguous key cache seen as slots
        v_cache_ptr,  # (num_blocks * block_size, nkv, hd) contiguous value cache seen as slots
        block_tables_ptr,  # (B, max_blocks) int32 block ids of each request
        seq_lens_ptr,  # (B,) int32 context length of each request, this iteration's tokens included
        query_start_loc_ptr,  # (B + 1,) int32 offsets of each request's tokens in q
        scale,  # softmax scale, usually hd ** -0.5
        num_seqs,  # B
        stride_qt,  # q stride between tokens
        stride_qh,  # q stride between heads
        stride_ot,  # out stride between tokens
        stride_oh,  # out stride between heads
        stride_cs,  # cache stride between slots (= nkv * hd)
        stride_ch,  # cache stride between kv heads (= hd)
        stride_bt,  # block_tables row stride
        BLOCK_SIZE: tl.constexpr,  # KV cache block size (tokens per block)
        GROUP: tl.constexpr,  # query heads per kv head
        GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two
        HEAD_DIM: tl.constexpr,  # real head size
        BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two
        BLOCK_M: tl.constexpr,  # rows per program = BLOCK_Q query tokens x GROUP_PAD heads
        BLOCK_Q: tl.constexpr,  # query tokens per program
        BLOCK_N: tl.constexpr,  # KV positions per inner-loop step
        DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 (no TF32, to match torch), else None (Triton's default)
        UPCAST: tl.constexpr,  # do dots in fp32: the interpreter's np.matmul misreads bf16 (stored as uint16)
    ):
        # Grid: (virtual query blocks, kv heads). One program serves BLOCK_Q tokens of one request and all
        # GROUP query heads that share one kv head, so each K/V tile is loaded once for the whole group.
        q_block = tl.program_id(0)
        kv_head = tl.program_id(1)
        seq = _find_request(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        local_block = q_block - (q_start // BLOCK_Q + seq)
        if local_block * BLOCK_Q >= q_len:
            return  # a spare virtual block
        seq_len = tl.load(seq_lens_ptr + seq)
        context = seq_len - q_len  # tokens cached before this iteration

        offs_m = tl.arange(0, BLOCK_M)
        q_tok = local_block * BLOCK_Q + offs_m // GROUP_PAD  # (BLOCK_M,) token index within the request
        head = kv_head * GROUP + offs_m % GROUP_PAD  # (BLOCK_M,) query head
        row_ok = (q_tok < q_len) & (offs_m % GROUP_PAD < GROUP)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        tok = (q_start + q_tok).to(tl.int64)
        q = tl.load(
            q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
            mask=row_ok[:, None] & d_ok[None, :], other=0.0,
        )  # (BLOCK_M, BLOCK_D)  # fmt: skip
        if UPCAST:
            q = q.to(tl.float32)
        q_pos = context + q_tok  # (BLOCK_M,) absolute position of each row's token
        # Causality: the last token of this block sees positions < kv_end, nothing later is needed.
        kv_end = context + tl.minimum((local_block + 1) * BLOCK_Q, q_len)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running row max
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running softmax denominator
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        qk_scale = scale * 1.4426950408889634  # log2(e): exp2 is cheaper than exp
        for start_n in range(0, kv_end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)  # (BLOCK_N,) positions
            n_ok = offs_n < kv_end
            block_id = tl.load(block_tables_ptr + seq * stride_bt + offs_n // BLOCK_SIZE, mask=n_ok, other=0)
            slot = block_id.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE  # (BLOCK_N,)
            kv_offs = slot * stride_cs + kv_head * stride_ch
            k = tl.load(k_cache_ptr + kv_offs[None, :] + offs_d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0)
            s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
            s = tl.where((q_pos[:, None] >= offs_n[None, :]) & n_ok[None, :], s * qk_scale, float("-inf"))
            # Every row has seen position 0 by now except padding rows, which may stay at -inf: keep them finite.
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_new[:, None])  # (BLOCK_M, BLOCK_N)
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_cache_ptr + kv_offs[:, None] + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            p = p.to(v.dtype).to(q.dtype)  # round P to the cache dtype, as the GPU does (no-op unless UPCAST)
            acc = acc * alpha[:, None] + tl.dot(p, v.to(q.dtype), input_precision=DOT_PRECISION)
            m_i = m_new

        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :],
        )  # fmt: skip


def _attention_blocks(group: int, head_dim: int, max_query_len: int, element_size: int) -> dict[str, int]:
    """Tile sizes: tl.dot needs every dim >= 16; prefill wants taller tiles than decode; fp32 tiles get
    one fewer pipeline stage so K/V buffers fit in shared memory at head_dim 256."""
    group_pad = triton.next_power_of_2(group)
    block_m = max(16 if max_query_len * group_pad <= 16 else 64, group_pad)
    block_d = max(16, triton.next_power_of_2(head_dim))
    return {
        "GROUP_PAD": group_pad,
        "BLOCK_M": block_m,
        "BLOCK_Q": block_m // group_pad,
        "BLOCK_D": block_d,
        "BLOCK_N": 32 if block_d > 128 else 64,
        "num_warps": 8 if block_m * block_d >= 64 * 256 else 4,
        "num_stages": 2 if element_size == 4 else 3,
    }


def ragged_attention_triton(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                            scale: float, *, max_query_len: int | None = None,
                            max_seq_len: int | None = None) -> torch.Tensor:
    """Triton version of `ragged_attention_torch` (same arguments and result); fp16/bf16/fp32 inputs, fp32
    accumulation. `max_query_len` picks the tile shapes (default T - B + 1, a bound needing no device
    sync); `max_seq_len` is accepted for the common signature, the kernel needs no bound."""
    if triton is None:
        raise RuntimeError("ragged_attention_triton needs triton, which is not installed")
    _check_attention_args(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"triton attention supports fp16/bf16/fp32, got {query.dtype}")
    if query.stride(2) != 1 or block_tables.stride(1) != 1:
        raise ValueError("query needs a unit stride along head_dim and block_tables along its columns")
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    block_size, num_kv_heads = k_cache.shape[1:3]
    if head_dim > 256:
        raise ValueError(f"head_dim {head_dim} > 256 is not supported")
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = num_tokens - num_seqs + 1
    upcast = query.device.type == "cpu" and query.dtype == torch.bfloat16  # only the interpreter runs on cpu
    cfg = _attention_blocks(num_heads // num_kv_heads, head_dim, max_query_len, query.element_size())
    grid = (num_tokens // cfg["BLOCK_Q"] + num_seqs, num_kv_heads)  # covers every request's query blocks
    _ragged_attention_kernel[grid](
        out, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, num_seqs,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        BLOCK_SIZE=block_size, GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 or upcast else None, UPCAST=upcast, **cfg,
    )  # fmt: skip
    return out
