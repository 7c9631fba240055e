"""KV-cache store: scatter one step's new K/V rows into their cache slots.

One program per token copies its [2, num_kv_heads, head_dim] row (K and V side by side, the
layout of both the fused q/k/v projection and the cache) to slot `slot_mapping[t]`. A negative
slot is skipped: CUDA-graph padding rows carry -1 so a padded replay writes nothing.

The int8 cache (engine/quant/kv_int8.py) is written by `store_kv_int8`: the same walk, with
each token's K and V head quantized on the way in against its own absolute maximum (codes in
[-127, 127], one float32 scale per token, head and K/V), bit for bit what the torch path's
`quantize_kv` writes: the same float32 division, and round-half-to-even done by adding and
subtracting 1.5 * 2^23 (exact for |x| < 2^22; the codes are at most 127), which needs no
libdevice call and so runs the same in the interpreter and on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.triton import check_device

_ROUND_MAGIC = 12582912.0  # 1.5 * 2**23: x + M - M rounds x to the nearest even integer


@triton.jit
def _store_kernel(
    kv_ptr, cache_ptr, scales_ptr, slot_ptr,
    stride_t, stride_kv, stride_h, stride_slot, stride_ckv, stride_ch, stride_sslot, stride_skv,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    QUANTIZE: tl.constexpr, ROUND_MAGIC: tl.constexpr,
):  # fmt: skip
    """One token's K and V rows to their slot; QUANTIZE: as int8 codes plus one float32 scale
    per head (`scales_ptr`), else as they are (`scales_ptr` unused)."""
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    h_mask = h < NUM_KV_HEADS
    mask = h_mask[:, None] & (d < HEAD_DIM)[None, :]
    for which in tl.static_range(2):  # K, then V
        src = kv_ptr + token * stride_t + which * stride_kv + h[:, None] * stride_h + d[None, :]
        dst = cache_ptr + slot * stride_slot + which * stride_ckv + h[:, None] * stride_ch
        if QUANTIZE:
            x = tl.load(src, mask=mask, other=0.0).to(tl.float32)
            # IEEE divisions (div_rn), as torch's: on CUDA `/` is the approximate division, and
            # codes one off quantize_kv's were seen on an H200 (bf16 input).
            scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 1), 1e-12), 127.0)  # [HEADS_PAD]
            q = tl.math.div_rn(x, scale[:, None])
            q = (q + ROUND_MAGIC) - ROUND_MAGIC
            q = tl.minimum(tl.maximum(q, -127.0), 127.0)
            tl.store(dst + d[None, :], q.to(tl.int8), mask=mask)
            tl.store(scales_ptr + slot * stride_sslot + which * stride_skv + h, scale, mask=h_mask)
        else:
            tl.store(dst + d[None, :], tl.load(src, mask=mask), mask=mask)


def _launch(kv, cache, scales, slot_mapping) -> None:
    num_tokens, _, num_kv_heads, head_dim = kv.shape
    quantize = scales is not None
    _store_kernel[(num_tokens,)](
        kv, cache, scales if quantize else cache, slot_mapping,
        kv.stride(0), kv.stride(1), kv.stride(2),
        cache.stride(1), cache.stride(2), cache.stride(3),
        scales.stride(1) if quantize else 0, scales.stride(2) if quantize else 0,
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        QUANTIZE=quantize, ROUND_MAGIC=_ROUND_MAGIC,
    )  # fmt: skip


def store_kv(
    kv: torch.Tensor,  # [num_tokens, 2, num_kv_heads, head_dim] (rows may be strided views)
    kv_cache: torch.Tensor,  # [num_kv_blocks, block_size, 2, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int32/int64; < 0 skips the token
) -> None:
    check_device(kv, kv_cache, slot_mapping)
    num_tokens = kv.shape[0]
    if kv.stride(-1) != 1 or not kv_cache.is_contiguous():
        raise ValueError("kv needs a unit stride on head_dim and kv_cache must be contiguous")
    if num_tokens == 0:
        return
    _launch(kv, kv_cache, None, slot_mapping)


def store_kv_int8(
    kv: torch.Tensor,  # [num_tokens, 2, num_kv_heads, head_dim] float (rows may be strided)
    codes: torch.Tensor,  # [num_kv_blocks, block_size, 2, num_kv_heads, head_dim] int8
    scales: torch.Tensor,  # [num_kv_blocks, block_size, 2, num_kv_heads] float32
    slot_mapping: torch.Tensor,  # [num_tokens]; < 0 skips the token
) -> None:
    """Quantize a step's K/V per token and head, and scatter codes and scales to their slots."""
    check_device(kv, codes, scales, slot_mapping)
    num_tokens = kv.shape[0]
    if kv.stride(-1) != 1 or not codes.is_contiguous() or not scales.is_contiguous():
        raise ValueError("kv needs a unit stride on head_dim; codes and scales must be contiguous")
    if codes.dtype != torch.int8 or scales.dtype != torch.float32:
        raise ValueError(
            f"int8 codes and float32 scales expected, got {codes.dtype}, {scales.dtype}"
        )
    if num_tokens == 0:
        return
    _launch(kv, codes, scales, slot_mapping)


def store_kv_ref(kv, kv_cache, slot_mapping) -> None:
    """The torch path's write (`index_copy_` into the flat slot view), skipping slots < 0."""
    keep = slot_mapping >= 0
    kv_cache.view(-1, *kv_cache.shape[2:]).index_copy_(0, slot_mapping[keep].long(), kv[keep])
