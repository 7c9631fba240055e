"""int8 KV cache: K and V stored as int8 with one float32 scale per token, per head (K and V
separately), read through the same paged layout as the float cache.

Per layer: codes [num_kv_blocks, block_size, 2, num_kv_heads, head_dim] int8 and scales
[num_kv_blocks, block_size, 2, num_kv_heads] float32. A token's K (or V) head is quantized
symmetrically to [-127, 127] against its own absolute maximum when it is written, so a scale
never changes after the write and blocks can be shared by prefix caching as they are.

Bytes per token and layer (SmolLM2: 3 KV heads x 64): 2 x 3 x (64 + 4) = 408, against 768 in
bf16 and 1536 in fp32: the same pool holds 1.88x the tokens of bf16 (3.8x fp32).

Reading: the attention backend here (`Int8PagedAttention`, the torch reference) gathers a
request's blocks, dequantizes them into the compute dtype and runs the same SDPA as
engine/layers/attention.py. On the C++ backend, decode rows instead go through its int8
kernel (`CpuInt8PagedAttention`, engine/layers/cpu_attention.py), which reads codes
and scales in place and dequantizes each row in fp32 as it reads it (no rounding to the
compute dtype between the two: bf16 results differ from the reference by bf16 rounding), and
stores new rows with `quantize_kv`'s bits in C++ (`store_kv_int8`: 10-14% faster steps with
int4 weights, `loadtest/results/kv-int8-store-session11.json`); the fused decode step
(engine/fused_decode.py) does both inside its one call, with the same bits (W1 4.2x, W2 1.5x
the per-operator path with int4 weights, `loadtest/results/kv-int8-fused-step-session12.json`);
the Triton kernels read it too (engine/kernels/triton). Measured in the engine
(`python -m loadtest.bench_kv_int8`, bf16 weights, 2-core Zen 4, 2 alternating rounds,
medians, `loadtest/results/kv-int8-cpu-kernel-20261203.json`): kernel over reference 1.10x at
W1 (1 x 128) and 1.53x at W2 (32 x 128); the reference's gather + dequantize of every context
in every layer is what the kernel saves. Every token, the chunk's own included, is attended to in its
dequantized form, so a result does not depend on how a prompt was chunked, preempted and
recomputed, or served from shared prefix blocks.
"""

from __future__ import annotations

import torch

from engine.kernels.attention_types import AttentionMetadata, Int8KVCache, PrefillChunk
from engine.layers.attention import decode_sdpa, prefill_sdpa


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int) -> int:
    return 2 * num_layers * block_size * num_kv_heads * (head_dim + 4)


def allocate(
    num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, zeros
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) pools for all layers; `zeros(shape, dtype)` allocates (lazily)."""
    codes = zeros((num_layers, num_blocks, block_size, 2, num_kv_heads, head_dim), torch.int8)
    scales = zeros((num_layers, num_blocks, block_size, 2, num_kv_heads), torch.float32)
    return codes, scales


def quantize_kv(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kv [num_tokens, 2, num_kv_heads, head_dim] -> (codes int8, same shape; scales float32
    [num_tokens, 2, num_kv_heads])."""
    kv = kv.float()
    # Divided by a 0-dim tensor on kv's device, not the number: on CUDA, torch computes a
    # division by a CPU scalar as a product with its reciprocal, one bit off the kernels' IEEE
    # division in ~5% of the scales (seen on an H200).
    amax = kv.abs().amax(dim=-1).clamp_min(1e-12)
    scales = amax / amax.new_full((), 127.0)
    codes = torch.round(kv / scales[..., None]).clamp_(-127, 127).to(torch.int8)
    return codes, scales


def dequantize_kv(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (codes.float() * scales[..., None]).to(dtype)


class Int8PagedAttention:
    """The torch reference attention over an int8 pool (same interface as
    engine.layers.attention.TorchPagedAttention: `forward(q, kv, kv_cache, meta)`)."""

    name = "torch-int8kv"

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim], already rotated
        kv: torch.Tensor,  # [num_tokens, 2, num_kv_heads, head_dim] new K (rotated) and V
        kv_cache: Int8KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        self._store(kv, kv_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        num_decodes = meta.num_decodes
        if num_decodes:
            out[:num_decodes] = self._decode(q[:num_decodes], kv_cache, meta)
        for chunk in meta.prefills:
            span = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
            out[span] = self._prefill(q[span], kv_cache, chunk, meta.slot_mapping[span])
        return out

    def _store(self, kv: torch.Tensor, kv_cache: Int8KVCache, slots: torch.Tensor) -> None:
        """The new K/V rows, quantized, into their slots."""
        codes, scales = quantize_kv(kv)
        kv_cache.codes.view(-1, *kv_cache.codes.shape[2:]).index_copy_(0, slots, codes)
        kv_cache.scales.view(-1, *kv_cache.scales.shape[2:]).index_copy_(0, slots, scales)

    @staticmethod
    def _gather(kv_cache: Int8KVCache, block_ids: torch.Tensor, dtype) -> torch.Tensor:
        """block_ids [*batch, num_blocks] -> dequantized [*batch, num_blocks * block_size, 2,
        num_kv_heads, head_dim]."""
        flat = block_ids.reshape(-1)
        context = dequantize_kv(kv_cache.codes[flat], kv_cache.scales[flat], dtype)
        return context.view(*block_ids.shape[:-1], -1, *kv_cache.codes.shape[2:])

    def _decode(self, q, kv_cache: Int8KVCache, meta: AttentionMetadata) -> torch.Tensor:
        num_decodes, num_heads, head_dim = q.shape
        num_kv_heads = kv_cache.codes.shape[3]
        grouped_q = q.view(num_decodes, num_kv_heads, num_heads // num_kv_heads, head_dim)
        context = self._gather(kv_cache, meta.decode_block_table, q.dtype)
        out = decode_sdpa(grouped_q, context, meta.decode_mask)
        return out.reshape(num_decodes, num_heads, head_dim)

    def _prefill(
        self, q, kv_cache: Int8KVCache, chunk: PrefillChunk, slots: torch.Tensor
    ) -> torch.Tensor:
        num_ctx = chunk.start_position + chunk.num_tokens
        if chunk.block_ids is not None:
            kv = self._gather(kv_cache, chunk.block_ids, q.dtype)[:num_ctx]
        else:  # the chunk's own tokens, read back dequantized from their slots
            flat_codes = kv_cache.codes.view(-1, *kv_cache.codes.shape[2:])
            flat_scales = kv_cache.scales.view(-1, *kv_cache.scales.shape[2:])
            kv = dequantize_kv(flat_codes[slots], flat_scales[slots], q.dtype)
        return prefill_sdpa(q, kv, chunk.mask, cached=chunk.causal_prefix)
