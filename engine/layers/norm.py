"""RMSNorm with an optional fused residual add, numerically the same as Hugging Face's.

HF normalises in float32 and casts back before multiplying by the weight; doing the same keeps
bf16/fp16 outputs identical to the reference rather than merely close.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        variance = x32.pow(2).mean(-1, keepdim=True)
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual), the
        pre-norm transformer's "add the branch output, then normalise" in one call.
        x, residual: [num_tokens, hidden]."""
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
