"""A tied embedding looked up in the quantized lm_head's int8 codes.

With tied embeddings and a quantized model, the lm_head holds int8 codes of the very table the
embedding looks rows up in, so keeping the float table too holds the same weights twice:
SmolLM2's bf16 table is 49152 x 576 x 2 = 54 MiB beside its 27 MiB of head codes (issue 17's
memory target). `share_head_codes` replaces the embedding with a lookup that dequantizes only
the rows asked for (a few per step), and frees the table.

Numerics: the embedding rows become the head's int8 per-row quantization of them (error up to
1/254 of the row's largest weight). Measured (loadtest/bench_accuracy.py, perplexity against
fp32, SmolLM2, the C++ kernel's VNNI path): int4 + int8 KV cache +1.89% (+1.79% with the
table); with exact activations int4 +0.38% (+0.16%), int8 +0.39% (+0.19%). The bounds are +2%
and +1% (loadtest/JOURNAL.md): int4 keeps 0.11 points of margin.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.quant.linear import QuantLinear


class HeadEmbedding(nn.Module):
    """nn.Embedding's forward on a tied int8 lm_head: ids [n] -> rows [n, hidden] in `dtype`."""

    def __init__(self, head: QuantLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self.head = [head]  # a list: not a submodule, so no second path to its parameters
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        shape = input_ids.shape
        rows = self.head[0].dequantized_rows(input_ids.reshape(-1).long())
        return rows.to(self.dtype).view(*shape, self.embedding_dim)


def can_share(model: nn.Module) -> bool:
    """Whether `model` has a tied embedding and an int8 QuantLinear lm_head made from it."""
    head = getattr(model, "lm_head", None)
    inner = getattr(model, "model", None)
    return (
        getattr(model, "tie_word_embeddings", False)
        and isinstance(head, QuantLinear)
        and head.scheme != "int4"
        and isinstance(getattr(inner, "embed_tokens", None), nn.Embedding)
        and inner.embed_tokens.weight.shape == (head.out_features, head.in_features)
    )


def share_head_codes(model: nn.Module) -> bool:
    """Replace the tied embedding (after loading) by a lookup in lm_head's codes and free its
    float table; whether it did (see `can_share`)."""
    if not can_share(model):
        return False
    dtype = model.model.embed_tokens.weight.dtype
    model.model.embed_tokens = HeadEmbedding(model.lm_head, dtype)
    return True
