"""Tensor-level quantization primitives: quantize, dequantize, and the per-token activation
quantizer of w8a8. No modules here: the layers (engine/quant/linear.py) and the offline cache
(engine/quant/cache.py) are built on these.

Canonical (stored) forms, chosen so that a checkpoint cache and a GGUF file map onto them
without a float round trip:
- int8: codes int8 [out, in] in [-127, 127], scale float32 [out]; w = scale[o] * q.
  Symmetric and per output channel: the scale folds into the GEMM epilogue.
- int4: codes uint8 [out, in] in [0, 15] (one code per byte; packed into nibbles only by the
  kernel layout), scale and minimum float32 [out, in // group_size] holding fp16 values;
  w = scale * q + minimum. This is exactly GGUF Q4_1's block (d, m, 32 codes), so Q4_1 tensors
  load as they are.
"""

from __future__ import annotations

import torch

INT4_GROUP_SIZES = (32, 64, 128)


def quantize_int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] (any float) -> (codes int8 [out, in], scale float32 [out])."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    codes = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes, scale


def dequantize_int8(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """-> float32 [out, in]."""
    return codes.float() * scale.float()[:, None]


def quantize_int4_groupwise(
    weight: torch.Tensor, group_size: int = 32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (codes uint8 [out, in] in [0, 15], scale, minimum float32
    [out, in // group_size]), asymmetric per group: w ~ scale * q + minimum."""
    out_features, in_features = weight.shape
    check_group_size(in_features, group_size)
    w = weight.float().reshape(out_features, in_features // group_size, group_size)
    low, high = w.amin(dim=2), w.amax(dim=2)
    # Scale and minimum are fp16 values (stored as float32), as in GGUF's Q4_1: the kernel's
    # layout keeps them in fp16. The codes are chosen for the rounded pair.
    low = _to_fp16_values(low)
    scale = _to_fp16_values(((high - low) / 15.0).clamp_min(FP16_TINY))
    codes = torch.round((w - low[..., None]) / scale[..., None]).clamp_(0, 15)
    return codes.to(torch.uint8).reshape(out_features, in_features), scale, low


FP16_MAX, FP16_TINY = 65504.0, 2.0**-24


def _to_fp16_values(t: torch.Tensor) -> torch.Tensor:
    """float32 -> the nearest fp16 values, as float32 (clamped into fp16's finite range)."""
    return t.clamp(-FP16_MAX, FP16_MAX).half().float()


def dequantize_int4(
    codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor
) -> torch.Tensor:
    """-> float32 [out, in]."""
    out_features, in_features = codes.shape
    group_size = in_features // scale.shape[1]
    q = codes.float().reshape(out_features, -1, group_size)
    return (q * scale.float()[..., None] + minimum.float()[..., None]).reshape(
        out_features, in_features
    )


def check_group_size(in_features: int, group_size: int) -> None:
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    if in_features % group_size:
        raise ValueError(
            f"int4 needs in_features ({in_features}) divisible by the group size ({group_size})"
        )


def quantize_per_token_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [rows, in] -> (codes int8 [rows, in], scale float32 [rows, 1]); symmetric,
    one scale per row (token), computed on the fly each step (dynamic quantization)."""
    xf = x.float()
    scale = xf.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127.0
    codes = torch.round(xf / scale).clamp_(-127, 127).to(torch.int8)
    return codes, scale
