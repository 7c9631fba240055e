"""RMSNorm with an optional fused residual add, numerically the same as Hugging Face's.

HF normalises in float32 and rounds to the model dtype before multiplying by the weight. In
bf16/fp16 one ulp matters more than it seems: bf16 logits near 25 are spaced 0.125 apart, so
greedy ties are common and an ulp in a norm changed SmolLM2's first answer token; HF's formula
keeps bf16 outputs bit-identical to HF's. The arithmetic lives in engine/layers/ops.py (the
torch formula, the fused C++ op with the same bits, the Triton kernel), chosen once per model.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.ops import TORCH_OPS, PointwiseOps


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype), requires_grad=False)
        self.ops: PointwiseOps = TORCH_OPS  # the runner's choice (engine/layers/ops.py use_ops)

    @property
    def kernels(self):
        """The fused C++ ops where this norm runs them, else None (the fused decode step reads
        it, with `lanes`, to take the same path)."""
        return self.ops.kernels if self.ops.names["rms_norm"] == "fused" else None

    @property
    def lanes(self) -> int:
        return self.ops.lanes[0]  # torch's sum width, which the fused op follows

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual), the
        pre-norm transformer's "add the branch output, then normalise" in one call.
        x, residual: [num_tokens, hidden]."""
        return self.ops.rms_norm(x, self.weight, self.eps, residual)
