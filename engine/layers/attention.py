"""Paged attention: K/V live in one pre-allocated block pool per layer, read through block tables.

Cache layout, per layer: kv_cache [num_kv_blocks, block_size, 2, num_kv_heads, head_dim], K and
V of a slot side by side. The fused q/k/v projection leaves a token's k and v adjacent too, so
writing a step's new K/V is one `index_copy_` into the flat view [num_slots, 2, kv, hd] at
slot = block_id * block_size + position % block_size, and gathering a request's context is one
`index_select` of whole blocks (contiguous rows of block_size * 2 * kv * hd values); K and V
are strided views of the result that SDPA reads in place.

The runner puts single-token requests (decodes) first in the flattened batch. They are attended
to in one SDPA call over a padded block table. Multi-token chunks (prefill) go one by one with a
causal mask shifted by their start position, since they may follow cached prefix tokens.
Masks are additive float masks in the model dtype, built once per step by the runner (a bool
mask would be converted inside SDPA in every layer).

Backends share one interface (`forward(q, kv, kv_cache, meta)`); the torch one here is the
reference that any kernel backend is tested against. Which one a runner uses is decided in one
place, engine/attention_backends.py. The step's metadata types live below both the layers and
the kernels (engine/kernels/attention_types.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.attention_types import AttentionMetadata, PrefillChunk, additive_mask


def softcapped_attention(
    q: torch.Tensor,  # [batch, num_heads, num_queries, head_dim]
    k: torch.Tensor,  # [batch, num_kv_heads, num_keys, head_dim]
    v: torch.Tensor,  # [batch, num_kv_heads, num_keys, head_dim]
    mask: torch.Tensor | None,  # additive, broadcast to [batch, heads, queries, keys]
    scale: float,
    softcap: float,
) -> torch.Tensor:  # [batch, num_heads, num_queries, head_dim]
    """Attention whose scores are squashed to (-softcap, softcap) by softcap * tanh(s /
    softcap) before the mask (Gemma 2), which SDPA cannot do: HF's eager arithmetic, step for
    step (the softmax in float32). No mask: causal, for a chunk with no cached prefix."""
    if k.shape[1] != q.shape[1]:  # GQA: query head h reads KV head h // group, as HF's repeat_kv
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        causal = torch.ones(scores.shape[-2:], dtype=torch.bool).tril_()
        mask = additive_mask(causal, scores.dtype)
    probs = torch.softmax(scores + mask, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def _attend(q, k, v, mask, scale: float | None, softcap: float | None) -> torch.Tensor:
    if softcap is not None:
        return softcapped_attention(q, k, v, mask, scale or q.shape[-1] ** -0.5, softcap)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )  # fmt: skip


def decode_sdpa(
    grouped_q: torch.Tensor,  # [rows, num_kv_heads, group, head_dim]
    context: torch.Tensor,  # [rows, max_ctx, 2, num_kv_heads, head_dim] gathered K/V
    mask: torch.Tensor,  # [rows, 1, 1, max_ctx] additive
    scale: float | None = None,  # None: 1 / sqrt(head_dim)
    softcap: float | None = None,  # of the scores (softcapped_attention)
) -> torch.Tensor:  # [rows, num_kv_heads, group, head_dim]
    """Decode rows against their gathered context; K and V are strided views SDPA reads in
    place. Shared by the reference backends (bf16/fp32 pool, int8 pool)."""
    keys = context[:, :, 0].transpose(1, 2)  # [rows, kv, max_ctx, hd]
    values = context[:, :, 1].transpose(1, 2)
    return _attend(grouped_q, keys, values, mask, scale, softcap)


def prefill_sdpa(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv: torch.Tensor,  # [num_ctx, 2, num_kv_heads, head_dim]: the cached prefix, then the chunk
    mask: torch.Tensor | None,  # [num_tokens, num_ctx] additive; None: plain causal
    scale: float | None = None,
    softcap: float | None = None,
    cached: int = 0,  # where the mask is the plain causal one after this many cached tokens
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """One prefill chunk against its context (GQA without repeating K/V)."""
    if (
        cached and q.shape[0] >= SPLIT_MIN_TOKENS and softcap is None
        and q.device.type == "cpu" and q.dtype in _SPLIT_DTYPES
    ):  # fmt: skip
        return _prefill_split(q, kv, cached, scale)
    out = _attend(
        q.transpose(0, 1).unsqueeze(0),  # [1, num_heads, num_tokens, head_dim]
        kv[:, 0].transpose(0, 1).unsqueeze(0),  # [1, num_kv_heads, num_ctx, head_dim]
        kv[:, 1].transpose(0, 1).unsqueeze(0),
        mask, scale, softcap,
    )  # fmt: skip
    return out[0].transpose(0, 1)


_SPLIT_DTYPES = (torch.float32, torch.bfloat16)
# New tokens from which a chunk after cached tokens is split (`_prefill_split`): masked / split
# call time, bf16, 9 heads (2-core Xeon): 16 new tokens after 1024 cached 0.81, 256 after 1024
# 0.90, 256 after 4096 1.07, 512 after 1024 1.00, 1024 after 1024 1.46, 1024 after 3072 1.47
# (two calls and a merge cost more than the masked corner saves until the chunk is long).
SPLIT_MIN_TOKENS = 512


def _prefill_split(q: torch.Tensor, kv: torch.Tensor, cached: int, scale: float | None):
    """A chunk after `cached` tokens under the plain causal mask, as two attentions merged: the
    cached part with no mask, the chunk's own part causally (`is_causal`, which skips the
    blocks above the diagonal), each with its log-sum-exp (the CPU flash kernel returns it), and
    out = (o1 e^(l1 - m) + o2 e^(l2 - m)) / (e^(l1 - m) + e^(l2 - m)), m = max(l1, l2), in
    float32. The one masked call scores every (query, key) pair, the masked ones too: 2048 new
    tokens after 2048 cached, bf16, 9 heads: 112 against 125 ms; 1024 after 1024: 25 against
    32 (2-core Xeon); P4 1.08-1.17x. Its result is the masked call's within a rounding of the
    output dtype (the parts are rounded to it before the merge)."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    queries = q.transpose(0, 1).unsqueeze(0)  # [1, num_heads, num_tokens, head_dim]
    keys = kv[:, 0].transpose(0, 1).unsqueeze(0)  # [1, num_kv_heads, num_ctx, head_dim]
    values = kv[:, 1].transpose(0, 1).unsqueeze(0)
    o1, l1 = flash(queries, keys[:, :, :cached], values[:, :, :cached], scale=scale)[:2]
    o2, l2 = flash(queries, keys[:, :, cached:], values[:, :, cached:], is_causal=True,
                   scale=scale)[:2]  # fmt: skip
    top = torch.maximum(l1, l2)
    w1, w2 = (l1 - top).exp_().unsqueeze(-1), (l2 - top).exp_().unsqueeze(-1)
    out = (o1.float() * w1 + o2.float() * w2).div_(w1 + w2)
    return out.to(q.dtype)[0].transpose(0, 1)


class TorchPagedAttention:
    """Reference backend on torch ops: index_copy_ to write, index_select + SDPA to read.

    Gathered K/V go into a buffer reused by every layer and step: a fresh multi-megabyte tensor
    per layer costs page faults that doubled decode attention time in fp32. Decode rows are
    processed in chunks whose gathered K/V stay under `max_gather_bytes`, which bounds that
    buffer whatever the context length.
    """

    name = "torch"
    needs_decode_mask = True

    def __init__(
        self,
        max_gather_bytes: int = 32 << 20,
        scale: float | None = None,  # of q.k; None: 1 / sqrt(head_dim)
        softcap: float | None = None,  # of the scores (Gemma 2); None: none
    ):
        self.max_gather_bytes = max_gather_bytes
        self.scale, self.softcap = scale, softcap
        self._buffer: torch.Tensor | None = None

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim], already rotated
        kv: torch.Tensor,  # [num_tokens, 2, num_kv_heads, head_dim] new K (rotated) and V
        kv_cache: torch.Tensor,  # [num_kv_blocks, block_size, 2, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        kv_cache.view(-1, *kv_cache.shape[2:]).index_copy_(0, meta.slot_mapping, kv)
        num_decodes = meta.num_decodes
        if not meta.prefills:  # decode-only step: no output assembly needed
            return self._decode(q, kv_cache, meta)
        out = torch.empty_like(q)
        if num_decodes:
            out[:num_decodes] = self._decode(q[:num_decodes], kv_cache, meta)
        self._prefills(q, kv, kv_cache, meta.prefills, out)
        return out

    def _prefills(self, q, kv, kv_cache, chunks: list[PrefillChunk], out: torch.Tensor) -> None:
        """Write the rows of `out` that belong to the prefill chunks, one chunk at a time."""
        for chunk in chunks:
            span = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
            out[span] = self._prefill(q[span], kv[span], kv_cache, chunk)

    def _gather(self, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """kv_cache[block_ids] for block_ids [*batch, num_blocks] -> [*batch, num_blocks *
        block_size, 2, num_kv_heads, head_dim], written into the reused buffer."""
        num_blocks, block_numel = block_ids.numel(), kv_cache[0].numel()
        buffer = self._buffer
        if (
            buffer is None
            or buffer.numel() < num_blocks * block_numel
            or buffer.dtype != kv_cache.dtype
            or buffer.device != kv_cache.device
        ):
            buffer = self._buffer = torch.empty(
                num_blocks * block_numel, dtype=kv_cache.dtype, device=kv_cache.device
            )
        out = buffer[: num_blocks * block_numel].view(num_blocks, *kv_cache.shape[1:])
        torch.index_select(kv_cache, 0, block_ids.reshape(-1), out=out)
        return out.view(*block_ids.shape[:-1], -1, *kv_cache.shape[2:])

    def _decode(self, q, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        num_decodes, num_heads, head_dim = q.shape
        num_kv_heads = kv_cache.shape[3]
        table, mask = meta.decode_block_table, meta.decode_mask
        # GQA without repeating K/V: the query heads of one KV head become that head's "query
        # rows" ([num_decodes, num_kv_heads, group, head_dim]); head h maps to KV head h // group.
        grouped_q = q.view(num_decodes, num_kv_heads, num_heads // num_kv_heads, head_dim)
        row_bytes = table.shape[1] * kv_cache[0].numel() * kv_cache.element_size()
        rows_per_chunk = max(1, self.max_gather_bytes // row_bytes)
        outs = []
        for start in range(0, num_decodes, rows_per_chunk):
            rows = slice(start, start + rows_per_chunk)
            context = self._gather(kv_cache, table[rows])  # [rows, max_ctx, 2, kv, hd]
            outs.append(decode_sdpa(grouped_q[rows], context, mask[rows], self.scale, self.softcap))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out.reshape(num_decodes, num_heads, head_dim)

    def _prefill(self, q, kv, kv_cache, chunk: PrefillChunk) -> torch.Tensor:
        if chunk.block_ids is not None:
            kv = self._gather(kv_cache, chunk.block_ids)[: chunk.start_position + chunk.num_tokens]
        return prefill_sdpa(q, kv, chunk.mask, self.scale, self.softcap, chunk.causal_prefix)
