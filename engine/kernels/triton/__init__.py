"""Triton kernels for the CUDA path, each beside its torch reference.

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


def require_usable() -> None:
    """Fail at start-up, not at the first step, where the kernels cannot run at all."""
    if not torch.cuda.is_available() and not is_interpreted():
        raise RuntimeError(
            "attention_backend='triton' needs a CUDA GPU; on CPU the Triton kernels run only in "
            "Triton's interpreter: set TRITON_INTERPRET=1 before the engine is imported (slow, "
            "for tests), or use attention_backend='torch'"
        )
