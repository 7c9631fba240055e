"""KV-cache store: scatter one step's new K/V rows into their cache slots.

One program per token copies its [2, num_kv_heads, head_dim] row (K and V side by side, the
layout of both the fused q/k/v projection and the cache) to slot `slot_mapping[t]`. A negative
slot is skipped: CUDA-graph padding rows carry -1 so a padded replay writes nothing.
(An int8 cache with quantize-on-store belongs here once the quantization issue defines one.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.triton import check_device


@triton.jit
def _store_kernel(
    kv_ptr, cache_ptr, slot_ptr,
    stride_t, stride_kv, stride_h, stride_slot, stride_ckv, stride_ch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    mask = (h < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    for which in tl.static_range(2):  # K, then V
        src = kv_ptr + token * stride_t + which * stride_kv + h[:, None] * stride_h + d[None, :]
        dst = cache_ptr + slot * stride_slot + which * stride_ckv + h[:, None] * stride_ch
        tl.store(dst + d[None, :], tl.load(src, mask=mask), mask=mask)


def store_kv(
    kv: torch.Tensor,  # [num_tokens, 2, num_kv_heads, head_dim] (rows may be strided views)
    kv_cache: torch.Tensor,  # [num_kv_blocks, block_size, 2, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int32/int64; < 0 skips the token
) -> None:
    check_device(kv, kv_cache, slot_mapping)
    num_tokens, _, num_kv_heads, head_dim = kv.shape
    if kv.stride(-1) != 1 or not kv_cache.is_contiguous():
        raise ValueError("kv needs a unit stride on head_dim and kv_cache must be contiguous")
    if num_tokens == 0:
        return
    _store_kernel[(num_tokens,)](
        kv, kv_cache, slot_mapping,
        kv.stride(0), kv.stride(1), kv.stride(2),
        kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
    )  # fmt: skip


def store_kv_ref(kv, kv_cache, slot_mapping) -> None:
    """The torch path's write (`index_copy_` into the flat slot view), skipping slots < 0."""
    keep = slot_mapping >= 0
    kv_cache.view(-1, *kv_cache.shape[2:]).index_copy_(0, slot_mapping[keep].long(), kv[keep])
