"""Paged attention in Triton: decode (split-K + reduction) and prefill/extend, beside torch
references that state the semantics in a few readable lines.

Both read K/V in place from the engine's cache [num_kv_blocks, block_size, 2, num_kv_heads,
head_dim] through a block table: token `pos` of a sequence lives in block
`table[pos // block_size]`, row `pos % block_size`. Nothing is gathered into a contiguous copy
(the torch path's `index_select` moves every context byte twice; the kernels move it once).

Decode (one query token per sequence): one program per (sequence, KV head, split). The query
heads that share a KV head (GQA) are the rows of one `tl.dot`, padded to 16 rows (the smallest
MMA tile), so each K/V byte is read once for the whole group. Long contexts are cut into splits
so that short batches still fill the GPU; each split keeps an online softmax (running max m,
sum l, unnormalised accumulator) and a reduction kernel merges the splits:
out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s with M = max_s m_s.

Prefill/extend (a chunk of tokens, possibly after a cached prefix): one program per (sequence,
tile of query tokens, query head); keys run from position 0 to the tile's last query position
with the causal mask `key_pos <= query_pos`. The chunk's own K/V are read from the cache too
(the store runs first), so a cached prefix and fresh tokens are one loop. Why Triton rather than
torch's SDPA/FlashAttention on contiguous chunks: SDPA needs each chunk's context contiguous, so
a chunk after a cached prefix pays a gather copy, and each chunk is a separate launch; this
kernel does every chunk of a step in one launch straight from the cache. For a long fresh
prompt FlashAttention may still win on raw FLOPs: `loadtest/gpu_check.py` times both on the
GPU (no GPU was available when this was written, so that number is still to be recorded here).

Softmax runs in base 2 (`exp2`, scale pre-multiplied by log2 e) with fp32 accumulation; the
probabilities are rounded to the cache dtype before the P.V product (the FlashAttention
convention). fp32 dots use IEEE precision (TF32 would cost about 1e-3 relative error).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from engine.kernels.triton import check_device, is_interpreted

LOG2_E = 1.4426950408889634
_DECODE_BLOCK_N = 64  # keys per inner-loop tile
_PREFILL_BLOCK_M = 32  # query tokens per program
_PREFILL_BLOCK_N = 32
# Split counts are runtime values (one compiled kernel for every batch size and context), and
# the reduction always spans this many, masked.
_MAX_SPLITS = 64


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _upcast_dots(dtype: torch.dtype) -> bool:
    """The interpreter computes bf16/fp16 `tl.dot` wrongly (garbage, checked with triton 3.9):
    there the operands are widened to fp32 after their rounding to the cache dtype, which keeps
    the numbers a bf16 MMA with fp32 accumulation gives."""
    return is_interpreted() and dtype != torch.float32


@triton.jit
def _mma(a, b, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _load_kv_tile(
    kv_ptr, scales_ptr, table_row_ptr, pos, valid, kv_head, d, d_mask,
    stride_kb, stride_ks, stride_kkv, stride_kh, BLOCK_SIZE: tl.constexpr,
    KV_INT8: tl.constexpr, COMPUTE_DTYPE: tl.constexpr,
):  # fmt: skip
    """K and V ([len(pos), HEAD_DIM_PAD], 0 where not valid) of positions `pos` of one
    sequence, read in place through its block-table row: decode and prefill share this.

    With KV_INT8 the cache holds int8 codes and `scales_ptr` a float32 scale per (slot, K/V,
    KV head) laid out like the codes without head_dim; codes * scale is rounded to the
    compute dtype, as the torch path's `dequantize_kv` does."""
    block = tl.load(table_row_ptr + pos // BLOCK_SIZE, mask=valid, other=0)
    slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
    row = block.to(tl.int64) * stride_kb + (pos % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
    kv_mask = valid[:, None] & d_mask[None, :]
    k = tl.load(kv_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(kv_ptr + row[:, None] + stride_kkv + d[None, :], mask=kv_mask, other=0.0)
    if KV_INT8:
        num_kv_heads = stride_kkv // stride_kh
        scale_row = scales_ptr + (slot * 2) * num_kv_heads + kv_head
        k_scale = tl.load(scale_row, mask=valid, other=0.0)
        v_scale = tl.load(scale_row + num_kv_heads, mask=valid, other=0.0)
        k = (k.to(tl.float32) * k_scale[:, None]).to(COMPUTE_DTYPE)
        v = (v.to(tl.float32) * v_scale[:, None]).to(COMPUTE_DTYPE)
    return k, v


@triton.jit
def _decode_kernel(
    q_ptr, kv_ptr, scales_ptr, table_ptr, lens_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
    scale_log2e, tokens_per_split,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kkv, stride_kh,
    stride_tb, stride_ot, stride_oh,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    KV_INT8: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(lens_ptr + seq)
    lo = split * tokens_per_split
    hi = tl.minimum(context_len, lo + tokens_per_split)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(
        q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [GROUP_PAD, HEAD_DIM_PAD]

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n
        valid = pos < hi
        k, v = _load_kv_tile(
            kv_ptr, scales_ptr, table_ptr + seq * stride_tb, pos, valid, kv_head, d, d_mask,
            stride_kb, stride_ks, stride_kkv, stride_kh, BLOCK_SIZE,
            KV_INT8, q_ptr.dtype.element_ty,
        )  # fmt: skip
        s = _mma(q, tl.trans(k), UPCAST, DOT_PRECISION) * scale_log2e  # [G, N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _mma(p.to(v.dtype), v, UPCAST, DOT_PRECISION)
        m_i = m_new

    out_mask = g_mask[:, None] & d_mask[None, :]
    if not IS_SPLIT:
        # A zero-length row (CUDA-graph padding) has l = 0: write zeros, not NaN.
        denom = tl.where(l_i > 0, l_i, 1.0)
        out = acc / denom[:, None]
        tl.store(
            out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        # partials: acc [num_seqs, num_heads, NUM_SPLITS, HEAD_DIM_PAD], (m, l) [..., 2]
        part = (seq * (GROUP * tl.num_programs(1)) + heads) * tl.num_programs(2) + split
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + d[None, :], acc, mask=out_mask)
        tl.store(part_ml_ptr + part * 2, m_i, mask=g_mask)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr, stride_ot, stride_oh, num_splits,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    s_mask = s < num_splits
    part = (seq * tl.num_programs(1) + head) * num_splits + s
    m = tl.load(part_ml_ptr + part * 2, mask=s_mask, other=float("-inf"))
    l_s = tl.load(part_ml_ptr + part * 2 + 1, mask=s_mask, other=0.0)
    # Splits past a sequence's end hold m = -inf, l = 0, acc = 0: weight 0. All of them empty
    # (a zero-length padding row) gives zeros. (-inf - -inf is kept out of the exp2.)
    is_full = s_mask & (m > float("-inf"))
    m_max = tl.max(tl.where(is_full, m, -1e30), 0)
    w = tl.where(is_full, tl.exp2(tl.where(is_full, m, m_max) - m_max), 0.0)
    acc = tl.load(
        part_acc_ptr + part[:, None] * HEAD_DIM_PAD + d[None, :], mask=s_mask[:, None], other=0.0
    )
    denom = tl.sum(l_s * w, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(
        out_ptr + seq * stride_ot + head * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


def _check_cache(q, kv_cache, kv_scales) -> tuple[int, int]:
    """(block_size, num_kv_heads) of a float cache, or of an int8 one with its scales."""
    _, block_size, _, num_kv_heads, _ = kv_cache.shape
    num_heads = q.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads is not a multiple of {num_kv_heads} KV heads")
    if q.stride(-1) != 1 or not kv_cache.is_contiguous():
        raise ValueError("q needs a unit stride on head_dim and kv_cache must be contiguous")
    if (kv_cache.dtype == torch.int8) != (kv_scales is not None):
        raise ValueError("an int8 kv_cache needs its kv_scales, and only an int8 one takes them")
    if kv_scales is not None:
        check_device(kv_scales)
        if kv_scales.shape != kv_cache.shape[:-1] or not kv_scales.is_contiguous():
            raise ValueError(f"kv_scales must be contiguous {tuple(kv_cache.shape[:-1])}")
        if kv_scales.dtype != torch.float32:
            raise ValueError(f"kv_scales must be float32, got {kv_scales.dtype}")
    return block_size, num_kv_heads


def _scales_arg(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None) -> torch.Tensor:
    return kv_cache if kv_scales is None else kv_scales  # unused by the float kernels


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, num_sms: int) -> int:
    """Splits per (sequence, KV head) so that about two waves of programs fill `num_sms`
    multiprocessors, never more splits than key tiles (each split gets at least one tile)."""
    programs = num_seqs * num_kv_heads
    if programs >= num_sms:
        return 1
    max_tiles = triton.cdiv(max(max_context_len, 1), _DECODE_BLOCK_N)
    return max(1, min(max_tiles, triton.cdiv(2 * num_sms, programs), _MAX_SPLITS))


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # the interpreter: a few splits, so the split path is exercised


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [num_kv_blocks, block_size, 2, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks] int32/int64
    context_lens: torch.Tensor,  # [num_seqs] int32/int64, 0 allowed (gives zeros)
    scale: float,
    out: torch.Tensor | None = None,  # [num_seqs, num_heads, head_dim]
    num_splits: int | None = None,
    kv_scales: torch.Tensor | None = None,  # int8 cache: [num_kv_blocks, block_size, 2, KVH]
) -> torch.Tensor:
    """Attention of one new token per sequence over its cached context (an int8 `kv_cache`
    with its `kv_scales` is dequantized as it is read).

    The split count depends only on shapes (the table's width bounds the context), never on
    `context_lens`' values, so no device sync happens and the launch can be CUDA-graphed."""
    check_device(q, kv_cache, block_tables, context_lens)
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = _check_cache(q, kv_cache, kv_scales)
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    max_context_len = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_context_len, _num_sms(q.device))
    if not 1 <= num_splits <= _MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {_MAX_SPLITS}], got {num_splits}")
    tiles_per_split = triton.cdiv(triton.cdiv(max(max_context_len, 1), _DECODE_BLOCK_N), num_splits)
    tokens_per_split = tiles_per_split * _DECODE_BLOCK_N
    head_dim_pad = triton.next_power_of_2(head_dim)
    if num_splits > 1:
        part_acc = torch.empty(
            (num_seqs, num_heads, num_splits, head_dim_pad), dtype=torch.float32, device=q.device
        )
        part_ml = torch.empty(
            (num_seqs, num_heads, num_splits, 2), dtype=torch.float32, device=q.device
        )
    else:
        part_acc = part_ml = out  # unused
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, kv_cache, _scales_arg(kv_cache, kv_scales), block_tables, context_lens,
        out, part_acc, part_ml,
        scale * LOG2_E, tokens_per_split,
        q.stride(0), q.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0), out.stride(0), out.stride(1),
        BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_N=_DECODE_BLOCK_N,
        IS_SPLIT=num_splits > 1, DOT_PRECISION=_dot_precision(q.dtype),
        UPCAST=_upcast_dots(q.dtype), KV_INT8=kv_scales is not None,
    )  # fmt: skip
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part_acc, part_ml, out, out.stride(0), out.stride(1), num_splits,
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, SPLITS_PAD=_MAX_SPLITS,
        )  # fmt: skip
    return out


@triton.jit
def _prefill_kernel(
    q_ptr, kv_ptr, scales_ptr, table_ptr, cu_seqlens_ptr, prefix_lens_ptr, out_ptr, scale_log2e,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kkv, stride_kh,
    stride_tb, stride_ot, stride_oh,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, KV_INT8: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    head = tl.program_id(2)
    q_begin = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_begin
    if tile * BLOCK_M >= q_len:
        return
    prefix_len = tl.load(prefix_lens_ptr + seq)
    kv_head = head // GROUP

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < q_len
    d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = d < HEAD_DIM
    q = tl.load(
        q_ptr + (q_begin + offs_m)[:, None] * stride_qt + head * stride_qh + d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, HEAD_DIM_PAD]
    q_pos = prefix_len + offs_m
    # Causal: this tile's last query sees keys up to its own position.
    hi = prefix_len + tl.minimum(q_len, (tile + 1) * BLOCK_M)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(0, hi, BLOCK_N):
        pos = start + offs_n
        valid = pos < hi
        k, v = _load_kv_tile(
            kv_ptr, scales_ptr, table_ptr + seq * stride_tb, pos, valid, kv_head, d, d_mask,
            stride_kb, stride_ks, stride_kkv, stride_kh, BLOCK_SIZE,
            KV_INT8, q_ptr.dtype.element_ty,
        )  # fmt: skip
        s = _mma(q, tl.trans(k), UPCAST, DOT_PRECISION) * scale_log2e  # [M, N]
        # Key 0 is visible to every row, so each row's max is finite after the first tile.
        s = tl.where(valid[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _mma(p.to(v.dtype), v, UPCAST, DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(
        out_ptr + (q_begin + offs_m)[:, None] * stride_ot + head * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def paged_prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], the chunks back to back
    kv_cache: torch.Tensor,  # [num_kv_blocks, block_size, 2, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks]
    cu_seqlens: torch.Tensor,  # [num_seqs + 1]: chunk i is q[cu_seqlens[i]:cu_seqlens[i+1]]
    prefix_lens: torch.Tensor,  # [num_seqs]: cached tokens before each chunk
    max_chunk_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    kv_scales: torch.Tensor | None = None,  # int8 cache: [num_kv_blocks, block_size, 2, KVH]
) -> torch.Tensor:
    """Causal attention of each chunk over its cached prefix and itself, all K/V (the chunk's
    own included) read from the cache."""
    check_device(q, kv_cache, block_tables, cu_seqlens, prefix_lens)
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = _check_cache(q, kv_cache, kv_scales)
    if out is None:
        out = torch.empty_like(q)
    num_seqs = block_tables.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    grid = (num_seqs, triton.cdiv(max_chunk_len, _PREFILL_BLOCK_M), num_heads)
    _prefill_kernel[grid](
        q, kv_cache, _scales_arg(kv_cache, kv_scales), block_tables, cu_seqlens, prefix_lens,
        out, scale * LOG2_E,
        q.stride(0), q.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0), out.stride(0), out.stride(1),
        BLOCK_SIZE=block_size, GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_M=_PREFILL_BLOCK_M, BLOCK_N=_PREFILL_BLOCK_N,
        DOT_PRECISION=_dot_precision(q.dtype),
        UPCAST=_upcast_dots(q.dtype), KV_INT8=kv_scales is not None,
    )  # fmt: skip
    return out


# -- torch references -----------------------------------------------------------------------


def _gather_context(kv_cache, table_row, num_tokens, kv_scales=None, dtype=None):
    """[num_tokens, 2, num_kv_heads, head_dim] of one sequence, in float32 (an int8 cache is
    dequantized and rounded to the compute `dtype` first, as the kernels read it)."""
    block_size = kv_cache.shape[1]
    positions = torch.arange(num_tokens, device=kv_cache.device)
    blocks = table_row.long()[positions // block_size]
    context = kv_cache[blocks, positions % block_size].float()
    if kv_scales is not None:
        scales = kv_scales[blocks, positions % block_size]
        context = (context * scales[..., None]).to(dtype).float()
    return context


def _attend(q, keys, values, allowed, scale):
    """q [m, H, D], keys/values [n, KVH, D], allowed [m, n] -> [m, H, D] in float32."""
    group = q.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1)
    values = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("mhd,nhd->hmn", q.float(), keys) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hmn,nhd->mhd", torch.softmax(scores, dim=-1), values)


def paged_decode_attention_ref(
    q, kv_cache, block_tables, context_lens, scale, kv_scales=None
) -> torch.Tensor:
    """The semantics of `paged_decode_attention`, in float32, one sequence at a time."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for i, context_len in enumerate(context_lens.tolist()):
        if context_len == 0:
            continue
        context = _gather_context(kv_cache, block_tables[i], context_len, kv_scales, q.dtype)
        allowed = torch.ones(1, context_len, dtype=torch.bool, device=q.device)
        out[i] = _attend(q[i : i + 1], context[:, 0], context[:, 1], allowed, scale)[0]
    return out


def paged_prefill_attention_ref(
    q, kv_cache, block_tables, cu_seqlens, prefix_lens, scale, kv_scales=None
) -> torch.Tensor:
    """The semantics of `paged_prefill_attention`, in float32, one chunk at a time."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    bounds = cu_seqlens.tolist()
    for i, prefix_len in enumerate(prefix_lens.tolist()):
        begin, end = bounds[i], bounds[i + 1]
        num_ctx = prefix_len + end - begin
        context = _gather_context(kv_cache, block_tables[i], num_ctx, kv_scales, q.dtype)
        query_pos = torch.arange(prefix_len, num_ctx, device=q.device)
        allowed = torch.arange(num_ctx, device=q.device)[None, :] <= query_pos[:, None]
        out[begin:end] = _attend(q[begin:end], context[:, 0], context[:, 1], allowed, scale)
    return out
