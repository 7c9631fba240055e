"""Linear layers whose weights are filled in place by the loader.

Parameters are allocated once with `torch.empty` in the target dtype (no random init, no second
copy) and each carries a `weight_loader(param, loaded, shard_id)` that copies a checkpoint tensor
into it. `MergedLinear` fuses projections that read the same input (q/k/v, gate/up) into one
matmul: one [num_tokens, hidden] x [hidden, sum(out)] GEMM per layer instead of three.

This is the seam for quantization: a quantized linear only has to provide the same constructor
arguments, `forward` and `weight_loader`, and `make_linear`/`make_merged_linear` choose the class.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _param(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T + b with W [out_features, in_features], the Hugging Face layout."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = _param((out_features, in_features), dtype)
        self.weight.weight_loader = self.weight_loader
        self.bias = _param((out_features,), dtype) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no shard {shard_id!r}")
        if tuple(loaded.shape) != tuple(param.shape):
            raise ValueError(f"shape mismatch: checkpoint {tuple(loaded.shape)} vs {tuple(param.shape)}")
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [num_tokens, in_features] -> [num_tokens, out_features]
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of one input stacked along the output dim, loaded shard by shard."""

    def __init__(
        self, in_features: int, shard_sizes: dict[str, int], bias: bool, dtype: torch.dtype
    ):
        super().__init__(in_features, sum(shard_sizes.values()), bias, dtype)
        self.shard_sizes = dict(shard_sizes)
        self.shard_offsets: dict[str, int] = {}
        offset = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = offset
            offset += size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None) -> None:
        if shard_id not in self.shard_sizes:
            raise ValueError(f"unknown shard {shard_id!r}; expected one of {list(self.shard_sizes)}")
        target = param.data.narrow(0, self.shard_offsets[shard_id], self.shard_sizes[shard_id])
        if tuple(loaded.shape) != tuple(target.shape):
            raise ValueError(
                f"shard {shard_id!r}: checkpoint {tuple(loaded.shape)} vs {tuple(target.shape)}"
            )
        target.copy_(loaded)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Views of the fused output, one per shard, in construction order."""
        return y.split(list(self.shard_sizes.values()), dim=-1)


def make_linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> Linear:
    return Linear(in_features, out_features, bias, dtype)


def make_merged_linear(
    in_features: int, shard_sizes: dict[str, int], bias: bool, dtype: torch.dtype
) -> MergedLinear:
    return MergedLinear(in_features, shard_sizes, bias, dtype)
