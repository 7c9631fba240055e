"""Linear layers whose weights are filled in place by the loader.

Parameters are allocated once with `torch.empty` in the target dtype (no random init, no second
copy); the loader calls the layer's `weight_loader(param, loaded, shard_id)` to copy a checkpoint
tensor into one of them. (A bound loader stored on each parameter, vLLM's way, would make every
layer a reference cycle: a dropped engine would keep its weights until the cyclic GC runs.)
`MergedLinear` fuses projections that read the same input (q/k/v, gate/up) into one matmul: one
[num_tokens, hidden] x [hidden, sum(out)] GEMM per layer instead of three.

After loading, `pack()` may re-lay a weight out once in oneDNN's blocked GEMM format (a plain
`F.linear` in bf16/fp16 repacks the weight on every call). Whether it should is measured on the
running machine, per shape and dtype (engine/kernels/cpu/linear_choice.py): on a 2-core Xeon the
packed bf16 GEMM was about 1.7x faster at every decode batch size (SmolLM2, 30 layers: M = 1
13.3 -> 7.4 ms) while fp32 was faster plain for one row (30 vs 37 ms a step); on an AMD EPYC
Zen 4 packed fp32 wins at 1 row too (147 -> 70 us for [1, 576] x [576, 3072]). A dtype oneDNN
cannot pack on this CPU (fp16 without avx_ne_convert/avx512_fp16) stays plain: slower, never a
crash. A packed tied lm_head holds its own copy; the embedding keeps the plain table.

`pack("gemv")` instead re-lays a bf16 weight out for our own GEMV / small GEMM
(engine/kernels/cpu/bf16_gemm.py: weights in pairs along K for `vdpbf16ps`), which reads the
weights at the memory bandwidth for the row counts of decoding. The packed copy is the only one
kept: the layer runs our kernel for up to 16 rows and oneDNN's `F.linear` on a transient
unpacked copy beyond (`bf16_gemm.linear`), or our kernel at every row count where the
calibration timed it faster at a prefill's rows than that `F.linear` (linear_choice.py
`gemv_max_rows`) or oneDNN has no bf16 GEMM (`bf16_gemm.layer_max_rows`).

This is the seam for quantization: a quantized linear only has to provide the same constructor
arguments, `forward`, `weight_loader` and `pack`, and `make_linear`/`make_merged_linear` choose
the class.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.cpu import bf16_gemm
from engine.platform import can_pack_onednn


def is_packing_supported(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and can_pack_onednn(weight.dtype)


def is_gemv_supported(weight: torch.Tensor) -> bool:
    """Our bf16 kernel runs here: a CPU bf16 weight and an extension that built."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and bf16_gemm.load() is not None
    )


def _param(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T + b with W [out_features, in_features], the Hugging Face layout."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = _param((out_features, in_features), dtype)
        self.bias = _param((out_features,), dtype) if bias else None

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None
    ) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no shard {shard_id!r}")
        if tuple(loaded.shape) != tuple(param.shape):
            raise ValueError(
                f"shape mismatch: checkpoint {tuple(loaded.shape)} vs {tuple(param.shape)}"
            )
        param.data.copy_(loaded)

    # The weight's layout: "plain" (the checkpoint's), "packed" (oneDNN's) or "gemv" (ours).
    kernel = "plain"

    @property
    def is_packed(self) -> bool:
        return self.kernel != "plain"

    def pack(self, kernel: str = "packed", gemv_max_rows: int | None | str = "machine") -> None:
        """Swap the weight for its `kernel` layout ("packed": oneDNN's, "gemv": ours; call once,
        after loading). The plain weight is freed unless something else holds it (a tied
        embedding table does). A layout this CPU cannot run leaves the weight plain.
        `gemv_max_rows`: the most rows a call runs our kernel for (None: every row count;
        "machine": `bf16_gemm.layer_max_rows()`; the runner passes its shape's calibrated
        limit, engine/kernels/cpu/linear_choice.py `gemv_max_rows`)."""
        if kernel == "plain" or self.is_packed:
            return
        if kernel == "gemv":
            if not is_gemv_supported(self.weight):
                return
            self._gemv = bf16_gemm.load().bf16_gemm
            self._isa = bf16_gemm.isa_code()
            self._gemv_max_rows = (
                bf16_gemm.layer_max_rows() if gemv_max_rows == "machine" else gemv_max_rows
            )
            packed = bf16_gemm.pack(self.weight.detach())
        elif kernel == "packed":
            if not is_packing_supported(self.weight):
                return
            # The batch-size hint only tunes the layout; any M works with the packed weight.
            packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 32)
        else:
            raise ValueError(f"unknown linear kernel {kernel!r}")
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.kernel = kernel

    def unpack(self) -> None:
        """Back to the plain layout (the inverse of `pack`)."""
        if self.kernel == "packed":
            plain = self.weight.to_dense()
        elif self.kernel == "gemv":
            plain = bf16_gemm.unpack(self.weight, self.out_features, self.in_features)
        else:
            return
        self.weight = nn.Parameter(plain, requires_grad=False)
        self.kernel = "plain"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [num_tokens, in_features] -> [num_tokens, out_features]
        if self.kernel == "gemv":
            return bf16_gemm.linear(self._gemv, self._isa, x, self.weight, self.bias,
                                    self.out_features, self.in_features,
                                    self._gemv_max_rows)  # fmt: skip
        if self.kernel == "packed":
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
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

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None
    ) -> None:
        if shard_id not in self.shard_sizes:
            raise ValueError(
                f"unknown shard {shard_id!r}; expected one of {list(self.shard_sizes)}"
            )
        target = param.data.narrow(0, self.shard_offsets[shard_id], self.shard_sizes[shard_id])
        if tuple(loaded.shape) != tuple(target.shape):
            raise ValueError(
                f"shard {shard_id!r}: checkpoint {tuple(loaded.shape)} vs {tuple(target.shape)}"
            )
        target.copy_(loaded)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Views of the fused output, one per shard, in construction order."""
        return y.split(list(self.shard_sizes.values()), dim=-1)


def make_linear(
    in_features: int, out_features: int, bias: bool, dtype: torch.dtype, quant=None
) -> nn.Module:
    """`quant`: an engine.quant.QuantConfig, or None for the float layer."""
    if quant is not None:
        from engine.quant.linear import QuantLinear

        return QuantLinear(in_features, out_features, bias, dtype, quant)
    return Linear(in_features, out_features, bias, dtype)


def make_merged_linear(
    in_features: int, shard_sizes: dict[str, int], bias: bool, dtype: torch.dtype, quant=None
) -> nn.Module:
    if quant is not None:
        from engine.quant.linear import QuantMergedLinear

        return QuantMergedLinear(in_features, shard_sizes, bias, dtype, quant)
    return MergedLinear(in_features, shard_sizes, bias, dtype)
