"""Packed weights in transparent huge pages.

A decode step streams every packed weight once, and at one row that stream is the step: on the
2-core Zen 4 VM, a 128 MB read ran at 43-48 GB/s from memory advised MADV_HUGEPAGE against
28-34 GB/s from 4 KiB pages (alternating in one process, 3 processes; loadtest/JOURNAL.md).
Most of a small model's weights are under one huge page each (SmolLM2's layers: 0.3-1.1 MB),
so they are copied, once packed, into chunks of a shared arena that is advised as a whole.

`MINI_INFER_HUGE_PAGES`: "auto" (default: where the kernel offers transparent huge pages to
madvise, i.e. its mode is not "never"), "1" (ask anyway) or "0" (ordinary pages). A chunk is
freed with the last weight in it; the arena keeps the chunk it is filling, so a process that
drops its engine holds at most that one chunk's used part.
"""

from __future__ import annotations

import contextlib
import functools
import math
import mmap
import os
import threading
from pathlib import Path

import torch

from engine.platform import SWITCH_OFF, trim_heap

HUGE_PAGE_BYTES = 2 << 20
CHUNK_BYTES = 16 << 20  # a multiple of the huge page; larger tensors get a mapping of their own
ALIGN = 64  # bytes: each tensor starts on a cache line
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@functools.cache
def enabled() -> bool:
    """Whether packed weights go to huge-page memory (see the module doc)."""
    setting = os.environ.get("MINI_INFER_HUGE_PAGES", "auto").strip().lower()
    if setting in SWITCH_OFF:
        return False
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    if setting in ("1", "on", "true", "yes"):
        return True
    try:
        return "[never]" not in THP_MODE.read_text()
    except OSError:  # no THP here (another OS, a container without /sys): ordinary pages
        return False


def _mapping(nbytes: int) -> mmap.mmap:
    # What packing freed (plain or canonical weights, the packed copy this one replaces) stays
    # resident in the heap until trimmed, and nothing reuses it now that weights live here: hand
    # it back before committing more, or every layer's old copy sits on the load's peak
    # (SmolLM2 bf16: 807 MiB against 702 without huge pages).
    trim_heap()
    size = -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # refused: ordinary pages, the same memory
        buffer.madvise(mmap.MADV_HUGEPAGE)
    return buffer


class Arena:
    """Bump allocation of tensors in huge-page-advised chunks."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.chunk_bytes = chunk_bytes
        self._chunk: mmap.mmap | None = None
        self._offset = 0
        self._lock = threading.Lock()

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = math.prod(shape)
        nbytes = max(numel * dtype.itemsize, 1)
        if nbytes > self.chunk_bytes // 2:
            buffer, offset = _mapping(nbytes), 0
        else:
            with self._lock:
                if self._chunk is None or self._offset + nbytes > self.chunk_bytes:
                    self._chunk, self._offset = _mapping(self.chunk_bytes), 0
                buffer, offset = self._chunk, self._offset
                self._offset += -(-nbytes // ALIGN) * ALIGN
        # The tensor holds the mapping (through the buffer protocol) for as long as it lives.
        flat = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=offset)
        return flat[: numel * dtype.itemsize].view(dtype).view(shape)


_ARENA = Arena()


def empty(shape: tuple[int, ...], dtype: torch.dtype, on: bool | None = None):
    """An uninitialised CPU tensor in huge-page memory where `on` (default: `enabled()`), else
    None: for a layout written there directly (no contiguous copy first)."""
    if not (enabled() if on is None else on) or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    return _ARENA.empty(tuple(shape), dtype)


def adopt(tensor: torch.Tensor, on: bool | None = None) -> torch.Tensor:
    """A contiguous CPU copy of `tensor` in huge-page memory where `on` (default: `enabled()`),
    else `tensor` itself. For weights packed once and then only read."""
    if tensor.device.type != "cpu" or tensor.numel() == 0:
        return tensor
    out = empty(tuple(tensor.shape), tensor.dtype, on)
    return tensor if out is None else out.copy_(tensor)
