"""The C++ bf16 GEMV / small GEMM (bf16_gemm.cpp): build once per machine, pack, call.

Why a kernel: at the row counts of decoding a linear is a read of its weights, and oneDNN's
packed bf16 GEMM read SmolLM2's at ~16 GB/s of the ~32-43 GB/s two Zen 4 cores stream. This
kernel reads each weight byte once, in order, with `vdpbf16ps` (32 MACs per instruction on
bf16 pairs) where the CPU has AVX-512 BF16; measured against oneDNN and a plain read of the same
bytes by `python -m loadtest.bench_bf16_gemv` (figures in loadtest/JOURNAL.md).

Layout (`pack`, once at load): [num_blocks, K2/2, 16, 2] bf16, output channels in blocks of 16
and each channel's inputs in pairs (see the .cpp). It replaces the checkpoint layout: a layer
keeps one copy (a tied lm_head keeps the embedding table plus this, as with oneDNN's layout).

Paths "avx512bf16", "avx512", "avx2" and "portable" (numbered as quant_gemm's) are all compiled
into one library and chosen per call, so each is forced and tested on any CPU that runs it
(tests/engine/kernels/test_bf16_gemm.py); `best_isa()` picks the widest.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

import torch

from engine import huge_pages as weight_pages
from engine.kernels.cpu import extension, quant_gemm
from engine.platform import can_pack_onednn

SOURCE = Path(__file__).with_name("bf16_gemm.cpp")
BLOCK = 16  # output channels per block of the packed layout
# Our kernel up to this many rows (decode batches); beyond, oneDNN's F.linear on a transient
# unpacked copy: prefill chunks are compute-bound (the copy is small beside the GEMM), and
# this way a prefill rounds exactly as Hugging Face's bf16 model does (tested on the real
# model: a prompt's logits bit-identical to HF's). Unless the layer's shape was calibrated
# with our kernel at a prefill's rows no slower than that copy and F.linear (linear_choice.py
# `gemv_max_rows`): on the 2-core Zen 5 a 39-token prompt's prefill took 143 ms on our kernel
# against 950 that way (1B shapes), 31 against 73 (SmolLM2). The fused decode step takes our
# kernel up to FUSED_MAX_ROWS decode rows (engine/fused_decode.py): measured on the Zen 4 VM
# (`bench_bf16_gemv --rows 1,16,32,64,256 --shapes smol`, load 2-3), at 32-64 rows F.linear on
# the plain weight took 0.96-1.33x our kernel's time before the fallback's copy, oneDNN on its
# packed layout 0.92-1.07x; at 1 row those were 2.4-3.4x and 1.8-2.1x.
GEMV_MAX_ROWS = 16
FUSED_MAX_ROWS = 64
# Up to this many rows a row's outputs have the bits it gets alone (bf16_gemm.cpp's `unroll`
# is the same for 1 to 3 rows): the verifying steps of speculative decoding rely on it
# (engine/fused_decode.py `speculate`).
ROWS_ALIKE = 3
# quant_gemm's paths but those that quantize activations (a bf16 weight has no integer codes)
ISAS = tuple(isa for isa in quant_gemm.ISAS if isa not in quant_gemm.INT8_ACTIVATION_ISAS)
can_run = quant_gemm.can_run


def layer_max_rows() -> int | None:
    """Rows up to which a layer on our kernel runs it (`linear`); None: every row count.

    GEMV_MAX_ROWS where oneDNN has a bf16 GEMM (native, or emulated on AVX-512 BW/VL/DQ). On a
    CPU without one (AVX2 only: AMD Zen 3, Intel's client cores) torch's bf16 `F.linear` falls
    back to a path 4-8x slower than our kernel at every row count (2-core Zen 3, SmolLM2's
    widths at 16-1024 rows; loadtest/JOURNAL.md, thirty-first session): a 39-token prompt took
    690 ms to its first token. There a prefill takes our kernel too and rounds as it does."""
    return GEMV_MAX_ROWS if can_pack_onednn(torch.bfloat16) else None


def best_isa() -> str:
    return quant_gemm.best_isa(int8_activations=False)


def isa_code(isa: str | None = None) -> int:
    """The extension's number for `isa` (default: `best_isa()`): quant_gemm's numbering."""
    if isa in quant_gemm.INT8_ACTIVATION_ISAS:
        raise ValueError(f"{isa!r} is not a bf16 GEMV path; expected one of {ISAS}")
    return quant_gemm.isa_code(isa or best_isa())


def extension_name(source: Path = SOURCE) -> str:
    return f"mini_infer_bf16_gemm_{extension.source_digest(source)}"


def build(build_root: Path | None = None, source: Path = SOURCE) -> ModuleType | None:
    """Compile (or reuse) and import the extension; None, with a warning, if that fails.
    `source`: another checkout's bf16_gemm.cpp (a benchmark's baseline), in its own cache entry."""
    return extension.build(
        extension_name(source), source, [], build_root, event="bf16_gemm", fallback="oneDNN"
    )


@functools.cache
def load() -> ModuleType | None:
    """The extension for this machine, built at most once per process (and once per machine)."""
    return build()


def pack(weight: torch.Tensor, huge_pages: bool | None = None) -> torch.Tensor:
    """weight [out, in] (any float dtype) -> bf16 [ceil(out/16), ceil(in/2), 16, 2], zero
    padded: packed[b, p, j, i] = weight[16b + j, 2p + i]. `huge_pages` (default: the setting
    of engine/huge_pages.py): in memory advised for transparent huge pages."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be [out_features, in_features], got {tuple(weight.shape)}")
    out_features, in_features = weight.shape
    w = weight.detach().to(torch.bfloat16)
    w = torch.nn.functional.pad(w, (0, in_features % 2, 0, -out_features % BLOCK))
    num_blocks, num_pairs = w.shape[0] // BLOCK, w.shape[1] // 2
    layout = w.reshape(num_blocks, BLOCK, num_pairs, 2).transpose(1, 2)
    target = weight_pages.empty(layout.shape, torch.bfloat16, huge_pages)
    return layout.contiguous() if target is None else target.copy_(layout)


SCREEN_ISAS = ("portable", "avx2", "avx512", "avx512vnni")  # the screen GEMV's paths


def pack_screen(codes: torch.Tensor) -> torch.Tensor:
    """An lm_head screen's int8 codes [out, in] -> int8 [ceil(out/16), ceil(in/2), 16, 2] as
    `pack` lays out bf16 weights (the screen GEMV's `vpdpwssd` takes lane j's pair of inputs
    side by side), zero padded."""
    if codes.dim() != 2 or codes.dtype != torch.int8:
        raise ValueError(f"codes must be int8 [out_features, in_features], got {codes.dtype} "
                         f"{tuple(codes.shape)}")  # fmt: skip
    out_features, in_features = codes.shape
    c = torch.nn.functional.pad(codes, (0, in_features % 2, 0, -out_features % BLOCK))
    num_blocks, num_pairs = c.shape[0] // BLOCK, c.shape[1] // 2
    return c.reshape(num_blocks, BLOCK, num_pairs, 2).transpose(1, 2).contiguous()


def screen_isa_code(isa: str | None = None) -> int:
    """The screen GEMV's number for `isa` (default: the widest of SCREEN_ISAS this CPU runs)."""
    isa = isa or next(i for i in reversed(SCREEN_ISAS) if can_run(i))
    if isa not in SCREEN_ISAS:
        raise ValueError(f"{isa!r} is not a screen GEMV path; expected one of {SCREEN_ISAS}")
    return quant_gemm.isa_code(isa)


def unpack(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The inverse of `pack`: bf16 [out_features, in_features]."""
    num_blocks, num_pairs = packed.shape[:2]
    w = packed.transpose(1, 2).reshape(num_blocks * BLOCK, num_pairs * 2)
    return w[:out_features, :in_features].contiguous()


def gemm(
    ext: ModuleType,
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    isa: str | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x bf16 [rows, in] -> bf16 [rows, out_features] (into `out` if given); `isa` forces a path
    (default: the widest this CPU runs)."""
    return ext.bf16_gemm(x, packed, bias, out_features, isa_code(isa), out)


def linear(
    call,
    isa: int,
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    in_features: int,
    max_rows: int | None,
) -> torch.Tensor:
    """A linear layer on a packed weight: x bf16 [rows, in] -> [rows, out_features]. `call` is
    the extension's `bf16_gemm` and `isa` its code, looked up once by the caller; past
    `max_rows` rows (None: never; `layer_max_rows()`) oneDNN on a transient unpacked copy."""
    if x.dim() == 2 and (max_rows is None or x.shape[0] <= max_rows):
        return call(x, packed, bias, out_features, isa, None)
    return torch.nn.functional.linear(x, unpack(packed, out_features, in_features), bias)
