"""Quantized linear layers behind the seam of engine/layers/linear.py.

Each class takes the same constructor arguments as `Linear`/`MergedLinear` (plus the
`QuantConfig`), and provides `forward`, `weight_loader` and `pack`. The loader hands
`weight_loader` float checkpoint tensors, which are quantized row block by row block (both
schemes are row-local, so quantizing a q/k/v shard alone gives the same codes as quantizing the
fused weight). Until `pack()` the layer holds the canonical tensors of
engine/quant/primitives.py (what the quantized cache stores) and computes with the dequantizing
reference; `pack()` turns them into the kernel layout once.

Kernels (no dequantize-then-matmul):
- at every row count, our C++ GEMV / small GEMM, engine/kernels/cpu/quant_gemm.py, for int8,
  int4 and w8a8's weight-only rows (below W8A8_INT_MM_MIN_ROWS), wherever it builds
  (QuantConfig.kernel "auto"; "torch" turns it off). Its layout is then the only copy of the
  codes (`pack`): torch's layout is built only where the C++ kernel is not used (or for
  torch.compile, and w8a8's `_int_mm`). It beat torch's weight-only kernels at every row
  count measured, 1 to 512 (torch's time / ours at 32, 128, 512 rows, load average 55, so
  noisy: gate_up int4 9.4 / 1.6 / 2.0, int8 0.8 / 1.4 / 1.5; down int4 1.6 / 2.7 / 1.2, int8
  1.2 / 2.6 / 1.4; lm_head int8 2.3 / 2.6 / 3.0; `bench_quant_kernels --rows 32,128,512`).
- otherwise torch 2.13's CPU ops:
  - int8: `aten._weight_int8pack_mm(x, codes [out, in], scale)`.
  - int4: `aten._convert_weight_to_int4pack_for_cpu` once, then
    `aten._weight_int4pack_mm_for_cpu` per call. It computes w = (q - 8) * s + z, so
    z = minimum + 8 * scale.
  - w8a8: activations quantized per token, `torch._int_mm(int8, int8) -> int32` (VNNI),
    rescaled by (token scale x channel scale). Below W8A8_INT_MM_MIN_ROWS the int8 weight-only
    kernel on unquantized activations is used instead (faster there, and more accurate): the
    same int8 weight serves both.

Measured against torch's kernels and bf16 at 1-64 rows (tables: loadtest/JOURNAL.md, "Kernel
measurements moved out of the code"): past a few rows bf16 beats every weight-only kernel.
Ours now serves every row count (the later 32-512-row run found it ahead at each).

`_weight_int8pack_mm` with float32 activations takes a slow path here (576->3072: 2.4 s for
512 rows against 86 ms in bf16, 224 vs 16 ms at 64 rows), so quantized models should be loaded
with dtype="bfloat16"; our kernel takes float32 activations at the same speed, so float32
decoding is no longer slow at few rows, only prefill is.

So the weight-only kernels win for one row (the single-stream latency case, and they halve or
quarter the weight bytes) and lose past a few rows; `_int_mm` is about even with bf16 at 32-64
rows. Hence w8a8 switches kernels at `W8A8_INT_MM_MIN_ROWS`. lm_head is quantized as int8
weight-only for every scheme (1.3x bf16 at one row with torch's kernel, 3.6x with ours; int4
would be faster still but cost 7% perplexity, see engine/quant/config.py).
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from engine import huge_pages
from engine.kernels.cpu import quant_gemm
from engine.quant.config import QuantConfig
from engine.quant.primitives import (
    check_group_size,
    dequantize_int4,
    dequantize_int8,
    quantize_int4_groupwise,
    quantize_int8_per_channel,
    quantize_per_token_int8,
)

# w8a8 uses _int_mm from this many rows on; below, the int8 weight-only kernel (see above).
W8A8_INT_MM_MIN_ROWS = 16


def _param(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


class QuantLinear(nn.Module):
    """y = x W^T + b with W quantized. `weight` holds the codes ([out, in], int8 or uint8);
    scales (and int4 minimums) are float32 buffers, so the loader's parameter walk finds
    exactly the tensors a checkpoint provides (weight, bias)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        quant: QuantConfig,
    ):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.dtype = dtype
        self.quant = quant
        self.scheme = quant.scheme
        self.is_packed = False
        self.cpp: ModuleType | None = None
        if self.scheme == "int4":
            check_group_size(in_features, quant.group_size)
            num_groups = in_features // quant.group_size
            self.weight = _param((out_features, in_features), torch.uint8)
            self.register_buffer("scale", torch.zeros(out_features, num_groups))
            self.register_buffer("minimum", torch.zeros(out_features, num_groups))
        else:
            self.weight = _param((out_features, in_features), torch.int8)
            self.register_buffer("scale", torch.zeros(out_features))
        self.bias = _param((out_features,), dtype) if bias else None

    # -- loading -----------------------------------------------------------------------------
    def _rows(self, shard_id: str | None) -> tuple[int, int]:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no shard {shard_id!r}")
        return 0, self.out_features

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None
    ) -> None:
        start, size = self._rows(shard_id)
        if param is self.bias:
            if tuple(loaded.shape) != (size,):
                raise ValueError(f"bias shard {shard_id!r}: {tuple(loaded.shape)} vs ({size},)")
            self.bias.data[start : start + size].copy_(loaded)
            return
        if tuple(loaded.shape) != (size, self.in_features):
            raise ValueError(
                f"shard {shard_id!r}: checkpoint {tuple(loaded.shape)} vs "
                f"{(size, self.in_features)}"
            )
        if self.scheme == "int4":
            codes, scale, minimum = quantize_int4_groupwise(loaded, self.quant.group_size)
            self.load_quantized(start, codes, scale, minimum)
        else:
            codes, scale = quantize_int8_per_channel(loaded)
            self.load_quantized(start, codes, scale)

    def load_quantized(
        self,
        row_start: int,
        codes: torch.Tensor,
        scale: torch.Tensor,
        minimum: torch.Tensor | None = None,
    ) -> None:
        """Copy already-quantized rows (canonical form) in: the quantized cache and GGUF Q4_1
        blocks come in this way, without a float round trip."""
        if self.is_packed:
            raise RuntimeError("cannot load into a packed quantized layer")
        rows = slice(row_start, row_start + codes.shape[0])
        self.weight.data[rows].copy_(codes)
        self.scale[rows].copy_(scale)
        if self.scheme == "int4":
            if minimum is None:
                raise ValueError("int4 rows need their minimums")
            self.minimum[rows].copy_(minimum)

    def quantized_state(self) -> dict[str, torch.Tensor]:
        """The canonical tensors (what the cache stores), by local name."""
        if self.is_packed:
            raise RuntimeError("the canonical tensors are gone once packed")
        state = {"weight": self.weight.data, "scale": self.scale}
        if self.scheme == "int4":
            state["minimum"] = self.minimum
        return state

    def dequantized_weight(self) -> torch.Tensor:
        """float32 [out, in]: what the codes stand for (the reference path and tests)."""
        if self.scheme == "int4":
            return dequantize_int4(self.weight.data, self.scale, self.minimum)
        return dequantize_int8(self.weight.data, self.scale)

    def dequantized_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """int8 only: float32 [len(ids), in], rows `ids` of what the codes stand for, from
        whichever layout holds them (a tied embedding looked up in the head's codes:
        engine/quant/embedding.py)."""
        if self.scheme == "int4":
            raise ValueError("row lookup is for int8 codes")
        if self.is_packed and not self.has_torch_layout:
            block = quant_gemm.BLOCK  # [blocks, in, 16]: row r at (r // 16, :, r % 16)
            return self.cpp_codes[ids // block, :, ids % block].float() * self.cpp_scales[ids, None]
        return self.weight.data[ids].float() * self.scale[ids, None]

    # -- packing and compute ---------------------------------------------------------------
    def pack(self, keep_torch_layout: bool = False) -> None:
        """Re-lay the canonical tensors out for the kernels (call once, after loading): one
        layout per weight, the C++ kernel's where it builds (it runs every row count), else
        torch's. `keep_torch_layout` (torch.compile, which cannot trace the pybind call) and
        w8a8 (its `_int_mm` rows) keep torch's beside it."""
        if self.is_packed:
            return
        self.cpp = self._pack_cpp()
        self.has_torch_layout = self.cpp is None or keep_torch_layout or self.scheme == "w8a8"
        if not self.has_torch_layout:
            # The canonical codes (1 byte per weight) and scales give way to the C++ layout,
            # then that moves to huge pages where the OS offers them (streamed whole every
            # decode step), once the canonical tensors are gone: two copies at a time, not three.
            del self.weight
            del self.scale
            if self.scheme == "int4":
                del self.minimum
            self.cpp_codes = huge_pages.adopt(self.cpp_codes)
            self.cpp_scales = huge_pages.adopt(self.cpp_scales)
            self.weight = nn.Parameter(self.cpp_codes, requires_grad=False)
        elif self.scheme == "int4":
            self._pack_torch_int4()
        else:
            self.scale_compute = self.scale.to(self.dtype)
        self.is_packed = True

    def _pack_torch_int4(self) -> None:
        # The kernel wants out_features a multiple of 16: pad with zero rows, slice after.
        pad = -self.out_features % 16
        codes, scale, zero = self.weight.data, self.scale, self.minimum + 8.0 * self.scale
        if pad:
            codes = torch.cat([codes, codes.new_zeros(pad, codes.shape[1])])
            scale = torch.cat([scale, scale.new_zeros(pad, scale.shape[1])])
            zero = torch.cat([zero, zero.new_zeros(pad, zero.shape[1])])
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 1)
        # [in // group_size, out, 2]: (scale, zero) per group, in the activation dtype.
        self.scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1)
        self.scales_and_zeros = self.scales_and_zeros.contiguous().to(self.dtype)
        # The uint8 codes (1 byte per weight) give way to the nibble-packed copy.
        self.weight = nn.Parameter(packed, requires_grad=False)
        del self.scale, self.minimum

    def _pack_cpp(self) -> ModuleType | None:
        """The C++ kernel's layout of the canonical tensors and the extension; None where the
        kernel is not asked for, did not build, or lacks the dtype. int4: 0.625 bytes per weight
        (codes and fp16 scale/minimum; torch's layout: 0.56), int8: 1 (+ 4 per row)."""
        if self.quant.kernel == "torch" or self.dtype not in quant_gemm.SUPPORTED_DTYPES:
            return None
        extension = quant_gemm.load()
        if extension is None:
            return None
        self.cpp_isa = quant_gemm.isa_code(quant_gemm.best_isa(self.quant.kernel == "auto"))
        if self.scheme == "int4":
            self.cpp_codes, self.cpp_scales = quant_gemm.pack_int4(
                self.weight.data, self.scale, self.minimum
            )
        else:
            self.cpp_codes, self.cpp_scales = quant_gemm.pack_int8(self.weight.data, self.scale)
        return extension

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [num_tokens, in_features] -> [num_tokens, out_features]
        if not self.is_packed:
            return self.forward_reference(x)
        rows = x.shape[0]
        if self.scheme == "w8a8" and rows >= W8A8_INT_MM_MIN_ROWS:
            y = _int8_gemm(x, self.weight, self.scale)  # before the C++ kernel: other math
        elif self.cpp is not None and not (
            self.has_torch_layout and torch.compiler.is_compiling()  # pybind breaks the graph
        ):
            y = self._forward_cpp(x)
        elif self.scheme == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x, self.weight, self.quant.group_size, self.scales_and_zeros
            )
            if y.shape[1] != self.out_features:
                y = y[:, : self.out_features]
        else:
            y = torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scale_compute)
        if self.bias is not None:
            y = y + self.bias
        return y

    def _forward_cpp(self, x: torch.Tensor) -> torch.Tensor:
        # The extension itself, not quant_gemm's wrappers: at one row, 121 calls a step.
        if self.scheme == "int4":
            return self.cpp.int4_gemm(
                x, self.cpp_codes, self.cpp_scales, self.quant.group_size, self.out_features,
                self.cpp_isa, None,
            )  # fmt: skip
        return self.cpp.int8_gemm(
            x, self.cpp_codes, self.cpp_scales, self.out_features, self.cpp_isa, None
        )

    def _kernel_quantizes_activations(self, x: torch.Tensor) -> bool:
        """Whether packing will give this layer the C++ kernel's int8-activation path for x
        (quant_gemm.py: "auto" kernel on a VNNI or AVX2 CPU, bf16 rows, at least its minimum
        rows)."""
        return (
            self.quant.kernel == "auto"
            and x.dtype == torch.bfloat16 == self.dtype
            and x.shape[0] >= quant_gemm.INT8_ACTIVATION_MIN_ROWS
            and self.in_features % quant_gemm.CHUNK == 0
            and quant_gemm.best_isa() in quant_gemm.INT8_ACTIVATION_ISAS
            and quant_gemm.load() is not None
        )

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """Dequantize-then-matmul in float32 (w8a8, and the C++ kernel's int8-activation path,
        also quantize the activations where the kernel does), cast to the input dtype: what the
        kernels are tested against."""
        weight = self.dequantized_weight()
        if self.scheme == "w8a8" and x.shape[0] >= W8A8_INT_MM_MIN_ROWS:
            codes, token_scale = quantize_per_token_int8(x)
            y = (codes.float() @ self.weight.data.float().t()) * token_scale * self.scale
        elif self._kernel_quantizes_activations(x):
            # As the kernel's int8-activation path: the activations as it quantizes them; an
            # int4 group's minimum multiplies them unquantized.
            minimum = torch.zeros_like(weight)
            if self.scheme == "int4":
                minimum = self.minimum.repeat_interleave(self.quant.group_size, dim=1)
            y = quant_gemm.quantize_activations(x) @ (weight - minimum).t() + x.float() @ minimum.t()
        else:
            y = x.float() @ weight.t()
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype)


def _int8_gemm(x: torch.Tensor, codes: torch.Tensor, channel_scale: torch.Tensor) -> torch.Tensor:
    """x [rows, in] float, codes int8 [out, in], channel_scale float32 [out] -> [rows, out]."""
    x_codes, token_scale = quantize_per_token_int8(x)
    accumulated = torch._int_mm(x_codes, codes.t())  # int32 [rows, out]
    return (accumulated.float() * token_scale * channel_scale).to(x.dtype)


class QuantMergedLinear(QuantLinear):
    """Several projections of one input stacked along the output dim, loaded shard by shard."""

    def __init__(
        self,
        in_features: int,
        shard_sizes: dict[str, int],
        bias: bool,
        dtype: torch.dtype,
        quant: QuantConfig,
    ):
        super().__init__(in_features, sum(shard_sizes.values()), bias, dtype, quant)
        self.shard_sizes = dict(shard_sizes)
        self.shard_offsets: dict[str, int] = {}
        offset = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = offset
            offset += size

    def _rows(self, shard_id: str | None) -> tuple[int, int]:
        if shard_id not in self.shard_sizes:
            raise ValueError(
                f"unknown shard {shard_id!r}; expected one of {list(self.shard_sizes)}"
            )
        return self.shard_offsets[shard_id], self.shard_sizes[shard_id]

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return y.split(list(self.shard_sizes.values()), dim=-1)
