"""RMSNorm with an optional fused residual add, numerically the same as Hugging Face's.

HF normalises in float32 and rounds to the model dtype before multiplying by the weight. In
float32 torch's fused `F.rms_norm` gives exactly those numbers in one op instead of seven, so it
is used there. In bf16/fp16 it rounds differently, and one ulp matters more than it seems:
bf16 logits near 25 are spaced 0.125 apart, so greedy ties are common and an ulp in a norm
changed SmolLM2's first answer token; HF's formula keeps bf16 outputs bit-identical to HF's.
On the CPU runner the model dtype's path is resolved once (`use_cpu`): in bf16/fp16 the fused
C++ op computes the same formula, with torch's summation order, in one call instead of nine.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype), requires_grad=False)
        self.kernels = None  # the fused C++ ops, where use_cpu chose them
        self.lanes = 8

    def use_cpu(self, kernels, lanes: tuple[int, int]) -> bool:
        """Resolve the CPU path once (no device check per call): the fused C++ add + norm
        (engine/kernels/cpu/fused_ops.cpp: same bits) for bf16/fp16 when `kernels` is given,
        else the torch formula. Returns whether the fused op was taken."""
        is_fused = kernels is not None and self.weight.dtype in (torch.bfloat16, torch.float16)
        self.kernels, self.lanes = (kernels, lanes[0]) if is_fused else (None, self.lanes)
        self.forward = self._forward_fused if is_fused else self._forward_torch
        return is_fused

    def _forward_fused(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            out = torch.empty_like(x)
            self.kernels.rms_norm(x, self.weight, out, self.eps, self.lanes)
            return out
        # x (the branch output, a fresh tensor) becomes the normalised sum; residual the sum.
        self.kernels.add_rms_norm_(x, residual, self.weight, self.eps, self.lanes)
        return x, residual

    def _forward_torch(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        variance = x32.pow(2).mean(-1, keepdim=True)
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual), the
        pre-norm transformer's "add the branch output, then normalise" in one call.
        x, residual: [num_tokens, hidden]."""
        if x.is_cuda:  # the add and the norm in one Triton kernel, HF's rounding kept
            from engine.kernels.triton.pointwise import rms_norm

            return rms_norm(x, self.weight, self.eps, residual)
        return self._forward_torch(x, residual)
