"""What a model runs in: the one resolver of `dtype` and `quantization`, "auto" included.

Every entry point passes its options here unchanged (`LLM(...)`, `LLMEngine`, `ModelRunner`,
the worker's MINI_INFER_DTYPE / MINI_INFER_QUANTIZATION and the `serve`, `demo` and `bench`
flags all default to "auto"), so they cannot disagree:

- quantization "auto": a model read from a GGUF runs in the GGUF's own quantization (Q4_0/Q4_1
  -> int4, Q8_0 -> int8: engine/quant/gguf.py `native_scheme`); any other checkpoint, and any
  model on CUDA (the quantized kernels are CPU ones), runs unquantized. None or "none": never
  quantized; "int4", "int8", ...: engine/quant/config.py.
- dtype "auto": bfloat16 wherever it runs fast here (`bf16_runs_fast`): natively (avx512_bf16,
  AMX), or on this machine's own C++ kernels, built for its AVX2 or AVX-512 and matching torch's
  dispatch (the bf16 and int4/int8 GEMVs, the fused ops and the fused decode step, which takes
  bf16 only). Then quantized layers compute in bfloat16 and an unquantized bf16 or fp16
  checkpoint runs bfloat16 (fp16 keeps itself where native fp16 is); everything else float32.
So the fp32, HF-exact path is `dtype="float32", quantization=None`.

Why the kernels count, not only the instruction: on an Intel Xeon with AVX-512 and VNNI but no
avx512_bf16, `mini-infer bench engine` (one round each, W1 / W2 tok/s) ran the default int4
model at 166 / 660 in bf16 against 22 / 165 in fp32, the bf16 checkpoint at 66 / 232 against
15 / 266; the same CPU limited to AVX2 (MINI_INFER_MAX_ISA=avx2 ATEN_CPU_CAPABILITY=avx2) 81 / 199
against 28 / 172 and 57 / 268 against 14 / 238. Without the fused ops (no compiler, or no match
with torch's dispatch) bf16 on such a CPU is torch's emulation, slower than fp32: then fp32.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine import platform
from engine.platform import has_native
from engine.quant.config import QuantConfig

AUTO = "auto"
DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}  # fmt: skip


def is_auto(value) -> bool:
    return isinstance(value, str) and value.strip().lower() == AUTO


def resolve_quantization(
    spec: str | QuantConfig | None, model_path: Path, device: str = "cpu"
) -> QuantConfig | None:
    """The QuantConfig a model loads with (None: unquantized)."""
    if not is_auto(spec):
        return QuantConfig.parse(spec)
    if device == "cuda":
        return None
    from engine.loader import gguf_source
    from engine.quant.gguf import native_scheme

    gguf_file = gguf_source(Path(model_path))
    return QuantConfig.parse(native_scheme(gguf_file) if gguf_file is not None else None)


def bf16_kernels_built() -> bool:
    """Whether this machine's C++ kernels take a bf16 decode step: the fused ops (they match
    torch's dispatch here), the fused step, the bf16 and quantized GEMVs, all built, for an
    AVX2 or AVX-512 CPU (the portable build is not measured to beat fp32)."""
    from engine.kernels.cpu import bf16_gemm, decode_step, fused_ops, quant_gemm

    if platform.cpu_info().vector_isa == "portable":
        return False
    return all(m.load() is not None for m in (fused_ops, decode_step, bf16_gemm, quant_gemm))


def bf16_runs_fast(device: str = "cpu") -> bool:
    """bf16 natively, or on our kernels (the module doc has the measurements)."""
    if has_native(torch.bfloat16, platform.cpu_info()):
        return True
    return device == "cpu" and bf16_kernels_built()


def resolve_dtype(
    dtype: torch.dtype | str, hf_config=None, quant: QuantConfig | None = None, device: str = "cpu"
) -> torch.dtype:
    """torch dtype for "auto" | "float32" | "bfloat16" | "float16" (or a torch dtype); ValueError
    else. "auto" needs `hf_config` (the checkpoint's dtype) and the resolved `quant`."""
    if is_auto(dtype):
        if hf_config is None:
            raise ValueError("dtype 'auto' needs the model's config to resolve")
        checkpoint = getattr(hf_config, "dtype", None)
        if isinstance(checkpoint, str):
            checkpoint = DTYPES.get(checkpoint.lower())
        if checkpoint == torch.float16 and quant is None and has_native(checkpoint):
            return checkpoint
        if quant is not None or checkpoint in (torch.bfloat16, torch.float16):
            return torch.bfloat16 if bf16_runs_fast(device) else torch.float32
        return torch.float32
    resolved = DTYPES.get(dtype.lower()) if isinstance(dtype, str) else dtype
    if resolved not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"unsupported dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return resolved


def resolve_precision(
    model_path: Path, hf_config, dtype, quantization, device: str = "cpu"
) -> tuple[torch.dtype, QuantConfig | None]:
    """(compute dtype, QuantConfig or None) for a model load."""
    quant = resolve_quantization(quantization, model_path, device)
    return resolve_dtype(dtype, hf_config, quant, device), quant
