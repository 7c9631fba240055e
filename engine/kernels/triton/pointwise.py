"""Fused row-wise kernels of the decoder layer: residual add + RMSNorm, RoPE in place on q and
k, SiLU(gate) * up. Each replaces several torch ops (and their HBM round trips) with one pass.

They round where the torch path (engine/layers) rounds, so bf16 results match it to the ulp or
better rather than drifting: the sum x + residual is rounded to the model dtype before it is
normalised, the normalised row is rounded before the weight multiply (Hugging Face's order),
each RoPE product is rounded before the add, SiLU is rounded before the multiply by `up`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine.kernels.triton import check_device


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_o, stride_ro,
    n, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = x.to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
        x = x.to(tl.float32)
    variance = tl.sum(x * x, 0) / n
    y = (x * tl.rsqrt(variance + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x), or with `residual` (norm(x + residual), x + residual): RMSNorm.forward's
    contract."""
    check_device(x, weight)
    num_tokens, hidden = x.shape
    if x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        raise ValueError("rms_norm needs unit-stride rows")
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else out
    if num_tokens:
        res = residual if residual is not None else x
        _rms_norm_kernel[(num_tokens,)](
            x, res, weight, out, res_out, x.stride(0), res.stride(0), out.stride(0),
            res_out.stride(0), hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(hidden),
        )  # fmt: skip
    return out if residual is None else (out, res_out)


def rms_norm_ref(x, weight, eps, residual=None):
    """Hugging Face's formula (float32 normalise, round, multiply), with the add in the model
    dtype first."""
    if residual is not None:
        x = x + residual
    x32 = x.float()
    y = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if residual is None else (y, x)


@triton.jit
def _rotary_kernel(
    x_ptr, cos_ptr, sin_ptr, stride_xt, stride_xh, stride_ct, stride_st, num_heads,
    HALF: tl.constexpr, HEADS_BLOCK: tl.constexpr, HALF_PAD: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    h = tl.program_id(1) * HEADS_BLOCK + tl.arange(0, HEADS_BLOCK)
    d = tl.arange(0, HALF_PAD)
    d_mask = d < HALF
    mask = (h < num_heads)[:, None] & d_mask[None, :]
    dt = x_ptr.dtype.element_ty
    # cos [head_dim]; signed sin = (-sin_1, sin_2), the halves HF's rotate_half pairs with.
    cos1 = tl.load(cos_ptr + token * stride_ct + d, mask=d_mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + token * stride_ct + HALF + d, mask=d_mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + token * stride_st + d, mask=d_mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + token * stride_st + HALF + d, mask=d_mask, other=0.0).to(tl.float32)
    base = x_ptr + token * stride_xt + h[:, None] * stride_xh + d[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    # torch: x * cos + roll(x) * signed_sin, each product rounded to the dtype, then the sum.
    a1 = (x1 * cos1[None, :]).to(dt).to(tl.float32)
    b1 = (x2 * sin1[None, :]).to(dt).to(tl.float32)
    a2 = (x2 * cos2[None, :]).to(dt).to(tl.float32)
    b2 = (x1 * sin2[None, :]).to(dt).to(tl.float32)
    tl.store(base, (a1 + b1).to(dt), mask=mask)
    tl.store(base + HALF, (a2 + b2).to(dt), mask=mask)


def rotary_(
    x: torch.Tensor,  # [num_tokens, num_heads, head_dim], may be a view into the qkv output
    cos: torch.Tensor,  # [num_tokens, 1, head_dim] (or [num_tokens, head_dim])
    signed_sin: torch.Tensor,  # same shape as cos: sin with its first half negated
) -> torch.Tensor:
    """rotary_torch_ (engine/layers/ops.py) in one kernel, in place; returns x."""
    check_device(x, cos, signed_sin)
    num_tokens, num_heads, head_dim = x.shape
    if head_dim % 2 or x.stride(-1) != 1 or cos.stride(-1) != 1 or signed_sin.stride(-1) != 1:
        raise ValueError("rotary_ needs an even head_dim and unit-stride rows")
    if num_tokens == 0:
        return x
    heads_block = min(16, triton.next_power_of_2(num_heads))
    _rotary_kernel[(num_tokens, triton.cdiv(num_heads, heads_block))](
        x, cos, signed_sin, x.stride(0), x.stride(1), cos.stride(0), signed_sin.stride(0),
        num_heads, HALF=head_dim // 2, HEADS_BLOCK=heads_block,
        HALF_PAD=triton.next_power_of_2(head_dim // 2),
    )  # fmt: skip
    return x


def rotary_ref_(x, cos, signed_sin):
    """The torch path (engine.layers.ops.rotary_torch_), restated."""
    if cos.dim() == 2:
        cos, signed_sin = cos[:, None], signed_sin[:, None]
    rotated = x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
    return torch.add(x * cos, rotated, out=x)


@triton.jit
def _silu_mul_kernel(
    gate_ptr, up_ptr, out_ptr, stride_g, stride_u, stride_o, n, BLOCK: tl.constexpr
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    dt = out_ptr.dtype.element_ty
    g = tl.load(gate_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (s * u).to(dt), mask=mask)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up for gate, up [num_tokens, intermediate] (views of the fused
    gate/up output are fine); returns a new [num_tokens, intermediate] tensor."""
    check_device(gate, up)
    if gate.shape != up.shape or gate.stride(-1) != 1 or up.stride(-1) != 1:
        raise ValueError("silu_and_mul needs same-shape gate/up with unit-stride rows")
    num_tokens, n = gate.shape
    out = torch.empty((num_tokens, n), dtype=gate.dtype, device=gate.device)
    if num_tokens:
        block = min(1024, triton.next_power_of_2(n))
        _silu_mul_kernel[(num_tokens, triton.cdiv(n, block))](
            gate, up, out, gate.stride(0), up.stride(0), out.stride(0), n, BLOCK=block
        )
    return out


def silu_and_mul_ref(gate, up):
    return F.silu(gate) * up
