"""What a model runs in: the one resolver of `dtype` and `quantization`, "auto" included.

Every entry point passes its options here unchanged (`LLM(...)`, `LLMEngine`, `ModelRunner`,
the worker's MINI_INFER_DTYPE / MINI_INFER_QUANTIZATION and the `serve`, `demo` and `bench`
flags all default to "auto"), so they cannot disagree:

- quantization "auto": a model read from a GGUF runs in the GGUF's own quantization (Q4_0/Q4_1
  -> int4, Q8_0 -> int8: engine/quant/gguf.py `native_scheme`); any other checkpoint, and any
  model on CUDA (the quantized kernels are CPU ones), runs unquantized. None or "none": never
  quantized; "int4", "int8", ...: engine/quant/config.py.
- dtype "auto": quantized layers compute in bfloat16 where this CPU has it natively, else
  float32; an unquantized checkpoint keeps its own dtype where native, a float16 one without
  native fp16 runs bfloat16 where that is native, everything else float32 (engine/platform.py).
So the fp32, HF-exact path is `dtype="float32", quantization=None`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.platform import auto_dtype, has_native
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


def resolve_dtype(
    dtype: torch.dtype | str, hf_config=None, quant: QuantConfig | None = None
) -> torch.dtype:
    """torch dtype for "auto" | "float32" | "bfloat16" | "float16" (or a torch dtype); ValueError
    else. "auto" needs `hf_config` (the checkpoint's dtype) and the resolved `quant`."""
    if is_auto(dtype):
        if hf_config is None:
            raise ValueError("dtype 'auto' needs the model's config to resolve")
        if quant is not None:
            return torch.bfloat16 if has_native(torch.bfloat16) else torch.float32
        checkpoint = getattr(hf_config, "dtype", None)
        if isinstance(checkpoint, str):
            checkpoint = DTYPES.get(checkpoint.lower())
        is_fp16_emulated = checkpoint == torch.float16 and not has_native(checkpoint)
        if is_fp16_emulated and has_native(torch.bfloat16):
            return torch.bfloat16
        return auto_dtype(checkpoint)
    resolved = DTYPES.get(dtype.lower()) if isinstance(dtype, str) else dtype
    if resolved not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"unsupported dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return resolved


def resolve_precision(
    model_path: Path, hf_config, dtype, quantization, device: str = "cpu"
) -> tuple[torch.dtype, QuantConfig | None]:
    """(compute dtype, QuantConfig or None) for a model load."""
    quant = resolve_quantization(quantization, model_path, device)
    return resolve_dtype(dtype, hf_config, quant), quant
