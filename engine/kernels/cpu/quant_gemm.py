"""The C++ quantized GEMV / small GEMM (quant_gemm.cpp): build once per machine, pack, call.

Why a kernel: torch's weight-only kernels fall short of the memory bandwidth at the row counts
of decoding. On the 2-core AMD EPYC Zen 4 VM, `aten._weight_int8pack_mm` reads a [49152, 576]
int8 weight for one row at 13 GB/s, against ~32 GB/s of read bandwidth; a weight-only GEMV
moves each weight byte once and does two flops with it, so it should run at the bandwidth.

Layout (packed once at load, `pack_int4` / `pack_int8`): output channels in blocks of 16, the
block's 16 codes for one input position side by side, so one AVX-512 vector lane is one output
channel and the weight stream is read in order, once, whatever the row count (rows reuse the
block's codes from L1). int4 keeps two inputs per byte (low nibble: even input) and a
(scale, minimum) float16 pair per channel and group (as GGUF's Q4_1: 0.625 bytes per weight;
fp32 pairs made it 0.75); int8 keeps the per-channel scale. The math
is the reference's (engine/quant/primitives.py), summed in another order: codes are widened to
fp32 in registers and multiplied with fp32 activations. The exceptions are "avx512vnni" and
"avx2_int8": like llama.cpp, they quantize bf16 activations to int8 per chunk of 32 inputs and
multiply with integer dot products (`vpdpbusd`, 64 multiply-adds an instruction; on AVX2
`vpmaddubsw`, 32), adding an activation rounding error the reference does not have
(`quantize_activations` is its reference). The two compute the same integer sums and scale
them in the same order: the same bits. They run from INT8_ACTIVATION_MIN_ROWS rows (one: at
one row the exact paths are bound by their instructions, widening codes to fp32, not by the
memory). QuantConfig kernel "exact" keeps the other paths.

Paths: "avx512vnni" (AVX-512 VNNI + VBMI: Ice Lake, Sapphire Rapids, Zen 4), "avx512bf16"
(int4 with bf16 activations: `vdpbf16ps` on codes turned into bf16 by bit operations, see the
.cpp; 1.5x the FMA path at 8 rows, even at 1), "avx512", "avx2_int8" (any AVX2 CPU: most
desktop and laptop x86 CPUs have no AVX-512), "avx2" and "portable" are all compiled into one
library (function-level target attributes) and chosen per call, so each is forced and tested on
any CPU that can run it (tests/engine/kernels/test_quant_gemm.py); `best_isa()` picks the
fastest this CPU has, in ISAS's order.
Multithreaded over blocks of output channels with at::parallel_for (a layer under ~32 KiB of
weights per task runs on one thread).

One row reaches the memory bandwidth (the int4 lm_head at ~33 GB/s on 2 Zen 4 threads, against
13 GB/s for torch's int8 kernel); the per-shape and in-engine numbers are in loadtest/JOURNAL.md,
"Kernel measurements moved out of the code".
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

import torch

from engine.kernels.cpu import extension
from engine.platform import cpu_info

SOURCE = Path(__file__).with_name("quant_gemm.cpp")
BLOCK = 16  # output channels per block of the packed layout
# In order of preference (`best_isa` takes the last this CPU runs). An AVX-512 CPU without
# VNNI (Skylake-SP) keeps the exact AVX-512 path: measured on the Xeon limited that way, the
# AVX2 int8 path ran as fast at one row and 1.1-1.4x at 4 (`bench_quant_kernels --isas`), and
# in the engine within the noise (loadtest/JOURNAL.md, thirtieth session): no speed to pay for
# the activations' rounding with.
ISAS = ("portable", "avx2", "avx2_int8", "avx512", "avx512bf16", "avx512vnni")
# Paths that quantize the activations to int8 (the others compute the reference's math).
INT8_ACTIVATION_ISAS = ("avx2_int8", "avx512vnni")
CHUNK = 32  # inputs per activation scale on those paths
# ... from this many rows; fewer take the exact path (quant_gemm.cpp, kVnniMinRows: every row
# count since the exact int4 path was measured bound by its instructions at one row).
INT8_ACTIVATION_MIN_ROWS = 1
# The extension's numbers (quant_gemm.cpp's `Isa`; bf16_gemm.cpp numbers its paths alike).
_ISA_CODE = {
    "portable": 0, "avx2": 1, "avx512": 2, "avx512bf16": 3, "avx512vnni": 4, "avx2_int8": 5
}
_ISA_FLAGS = {  # what the CPU must report for each path (Linux /proc/cpuinfo names)
    "portable": (),
    "avx2": ("avx2", "fma", "f16c"),
    "avx2_int8": ("avx2", "fma", "f16c"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "avx512bf16": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"),
    "avx512vnni": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512vbmi"),
}
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)


def extension_name() -> str:
    # One library holds every path (chosen per call), so the name needs no instruction set.
    return f"mini_infer_quant_gemm_{extension.source_digest(SOURCE)}"


def build(build_root: Path | None = None) -> ModuleType | None:
    """Compile (or reuse) and import the extension; None, with a warning, if that fails."""
    return extension.build(
        extension_name(), SOURCE, [], build_root, event="quant_gemm", fallback="torch quantized"
    )


@functools.cache
def load() -> ModuleType | None:
    """The extension for this machine, built at most once per process (and once per machine)."""
    return build()


def can_run(isa: str) -> bool:
    return cpu_info().has(*_ISA_FLAGS[isa])


@functools.cache
def best_isa(int8_activations: bool = True) -> str:
    """The fastest path this CPU runs; `int8_activations=False` keeps to the paths that compute
    the reference's math."""
    allowed = [isa for isa in ISAS if int8_activations or isa not in INT8_ACTIVATION_ISAS]
    return next(isa for isa in reversed(allowed) if can_run(isa))


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """What the int8-activation paths make of x [rows, K] (K a multiple of CHUNK), as float32:
    per row and chunk of 32 inputs, d = max|x| / 127 and x ~ d * round(x * 127 / max|x|)
    (round half to even, fp32 arithmetic as in the kernel). The reference of the tests."""
    rows, k = x.shape
    chunks = x.float().reshape(rows, k // CHUNK, CHUNK)
    amax = chunks.abs().amax(dim=-1, keepdim=True)
    # A tensor divided by a tensor: torch computes `127.0 / amax` as 127 * (1 / amax), which
    # is not the kernel's correctly rounded quotient.
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    codes = torch.round(chunks * inv)
    return (codes * (amax / 127.0)).reshape(rows, k)


def isa_code(isa: str | None = None) -> int:
    """The extension's number for `isa` (default: the widest this CPU runs); raises if this CPU
    cannot run it. Callers on a hot path take it once and call the extension directly."""
    isa = isa or best_isa()
    if isa not in _ISA_CODE:
        raise ValueError(f"unknown isa {isa!r}; expected one of {ISAS}")
    if not can_run(isa):
        raise RuntimeError(f"this CPU cannot run the {isa} path (needs {_ISA_FLAGS[isa]})")
    return _ISA_CODE[isa]


ANY_ROWS = 1 << 30  # `rows_alike` of a path that computes every row alike


def rows_alike(isa: int, in_features: int) -> int:
    """The most rows a call on path `isa` (a code) may have while each row's outputs keep the
    bits that row gets alone: what a step that verifies drafts as extra rows needs
    (engine/fused_decode.py `speculate`). The int8-activation path sums integers (exact in any
    order) and scales each chunk's sum in one order at every row count, and the portable path
    runs a row at a time: any count. The exact AVX-512 and AVX2 paths keep 4 accumulators a
    row up to 2 rows and 2 from 3 rows on (quant_gemm.cpp's `U`): their sums group otherwise
    past 2. (bf16 activations, as the fused step has them; quant_gemm.cpp `effective_isa`
    takes the int8-activation paths only for whole chunks of inputs.)"""
    if isa == _ISA_CODE["portable"]:
        return ANY_ROWS
    int8_activations = (_ISA_CODE[name] for name in INT8_ACTIVATION_ISAS)
    if isa in int8_activations and in_features % CHUNK == 0:
        return ANY_ROWS
    return 2


def _pad_blocks(t: torch.Tensor) -> torch.Tensor:
    """Pad dim 0 (output channels) with zeros to a multiple of BLOCK."""
    pad = -t.shape[0] % BLOCK
    return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t


def pack_int4(
    codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Canonical int4 (codes uint8 [out, in] in 0..15, scale/minimum float32 [out, groups]) ->
    (codes uint8 [blocks, in/2, 16], scale_min float16 [blocks, groups, 2, 16]). The scales and
    minimums are rounded to fp16: exact for what `quantize_int4_groupwise` and GGUF's Q4_1
    make (they are fp16 values already)."""
    out_features, in_features = codes.shape
    if in_features % 2 or scale.shape != minimum.shape or scale.shape[0] != out_features:
        raise ValueError(f"bad int4 tensors: {codes.shape}, {scale.shape}, {minimum.shape}")
    c = _pad_blocks(codes.to(torch.uint8))
    pairs = (c[:, 0::2] & 15) | ((c[:, 1::2] & 15) << 4)  # [out, in/2]
    packed = pairs.reshape(-1, BLOCK, in_features // 2).transpose(1, 2).contiguous()
    sm = torch.stack([_pad_blocks(scale.half()), _pad_blocks(minimum.half())], dim=-1)
    sm = sm.reshape(-1, BLOCK, scale.shape[1], 2).permute(0, 2, 3, 1).contiguous()
    return packed, sm


def pack_int8(codes: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Canonical int8 (codes int8 [out, in], scale float32 [out]) ->
    (codes int8 [blocks, in, 16], scale float32 [blocks * 16])."""
    out_features, in_features = codes.shape
    if scale.shape != (out_features,):
        raise ValueError(f"bad int8 tensors: {codes.shape}, {scale.shape}")
    c = _pad_blocks(codes.to(torch.int8))
    packed = c.reshape(-1, BLOCK, in_features).transpose(1, 2).contiguous()
    return packed, _pad_blocks(scale.float()).contiguous()


def int4_gemm(
    ext: ModuleType,
    x: torch.Tensor,
    packed: torch.Tensor,
    scale_min: torch.Tensor,
    group_size: int,
    out_features: int,
    isa: str | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [rows, in] float32/bfloat16 -> [rows, out_features] in x's dtype (into `out` if
    given); `isa` forces a path (default: the widest this CPU runs)."""
    return ext.int4_gemm(x, packed, scale_min, group_size, out_features, isa_code(isa), out)


def int8_gemm(
    ext: ModuleType,
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    out_features: int,
    isa: str | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """As `int4_gemm`, for int8 per-channel weights."""
    return ext.int8_gemm(x, packed, scale, out_features, isa_code(isa), out)
