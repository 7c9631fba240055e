"""Triton kernels for the CUDA path, each beside its torch reference.

- attention.py: paged decode attention (GQA, split-K + reduction), paged prefill/extend.
- kv_store.py: scatter a step's K/V into their cache slots (slot < 0: skipped).
- pointwise.py: fused residual add + RMSNorm, RoPE in place on q and k, SiLU * mul.
- backend.py: `TritonPagedAttention`, the attention-backend adapter (attention_backend
  "triton", and "auto" on the CUDA runner: engine/attention_backends.py).

Dispatch: engine/layers/ops.py hands the pointwise kernels to a model on CUDA (the CPU keeps
the torch chains or the fused C++ ops); attention goes through Triton when the backend is
"triton", which works anywhere Triton can run (a GPU, or the interpreter on CPU for tests).

Importing this package does not import Triton: the kernel modules are imported where they are
used, because `triton.jit` decides at decoration time whether a kernel is compiled for the GPU
or run by the interpreter (`TRITON_INTERPRET=1`, read when a kernel module is first imported).
On CPU tensors the kernels only run interpreted; `check_device` turns anything else into a
clear error instead of a crash deep inside Triton.
"""

from __future__ import annotations

import os

import torch


def is_interpreted() -> bool:
    """True when Triton kernels run in its interpreter (on CPU tensors, slowly, for tests)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def check_device(*tensors: torch.Tensor) -> None:
    """Raise unless every tensor is on CUDA, or on CPU with the Triton interpreter on."""
    for tensor in tensors:
        if tensor.is_cuda:
            continue
        if tensor.device.type == "cpu" and is_interpreted():
            continue
        raise RuntimeError(
            f"Triton kernels need CUDA tensors, got a {tensor.device.type} tensor; on CPU they run "
            "only in the Triton interpreter: set TRITON_INTERPRET=1 before the engine is imported "
            "(or use attention_backend='torch')"
        )


def unusable_reason() -> str | None:
    """Why the kernels cannot run in this process at all (None: they can)."""
    if not torch.cuda.is_available() and not is_interpreted():
        return (
            "attention_backend='triton' needs a CUDA GPU; on CPU the Triton kernels run only in "
            "Triton's interpreter: set TRITON_INTERPRET=1 before the engine is imported (slow, "
            "for tests), or use attention_backend='torch'"
        )
    return None


def require_usable() -> None:
    """Fail at start-up, not at the first step, where the kernels cannot run at all."""
    reason = unusable_reason()
    if reason is not None:
        raise RuntimeError(reason)
