"""Shared-library pages that only start-up used, handed back to the kernel.

`import torch` leaves 50-60 MiB of its libraries' code and read-only data resident (on the
2-core Zen 4 VM: libtorch_cpu 48 MiB, libtorch_python 11): static initializers and operator
registration run across the whole of libtorch_cpu, while a decode step runs a small part of it.
They are clean file pages. The kernel drops such pages when memory runs short, but until then
they count in the process's RSS, which is what `top`, a container's working set and the OOM
killer's score read. So the engine pages out the read-only mappings of every shared library in
the process (`madvise(MADV_PAGEOUT)`, Linux 5.4+) before it loads its model and again once it is
loaded (once per process: a later engine in the same process does not); what a step then runs
comes back from the page cache at first use (a minor fault per page, once: the first request
after start took ~30 ms longer on that VM) and counts in RSS again. RSS then holds what serving
uses, not what starting did: at W2 with int4 weights and the int8 KV cache, the peak went from
422 to 357 MiB, its file pages from 96 to 31 MiB (loadtest/JOURNAL.md).
Pages another process also maps are left where they are (the kernel skips them), and the page
cache may keep the pages it dropped from this process (reclaimable, as any file read is).

`MINI_INFER_RELEASE_LIBRARY_PAGES=0` keeps them.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import sys
from collections.abc import Iterator

from engine.platform import SWITCH_OFF

MADV_PAGEOUT = 21  # <linux/mman.h>, Linux 5.4
_READ_ONLY = ("r-xp", "r--p")  # code and read-only data: never written, always clean


def enabled() -> bool:
    setting = os.environ.get("MINI_INFER_RELEASE_LIBRARY_PAGES", "1").strip().lower()
    return sys.platform.startswith("linux") and setting not in SWITCH_OFF


def library_mappings(maps: str) -> Iterator[tuple[int, int]]:
    """(start, end) of the read-only private mappings of shared libraries in `maps` (the text
    of /proc/<pid>/maps): code and read-only data, never a writable or anonymous mapping, nor
    a data file mapped read-only (a GGUF's weights)."""
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or fields[1] not in _READ_ONLY:
            continue
        name = os.path.basename(fields[5].strip())
        if not (name.endswith(".so") or ".so." in name):
            continue
        start, _, end = fields[0].partition("-")
        yield int(start, 16), int(end, 16)


def page_out(ranges: Iterator[tuple[int, int]]) -> bool:
    """Ask the kernel to page out each address range; False where it cannot (not Linux, a
    kernel before 5.4, no libc)."""
    madvise = _madvise()
    if madvise is None:
        return False
    for start, end in ranges:
        failed = madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_PAGEOUT) != 0
        # EINVAL: the kernel has no MADV_PAGEOUT, and the rest would fail alike. ENOMEM: the
        # range was unmapped meanwhile (a library another thread unloaded): go on.
        if failed and ctypes.get_errno() == errno.EINVAL:
            return False
    return True


_released: set[str] = set()


def release_library_pages(stage: str) -> bool:
    """Page out this process's shared-library code and read-only data (see the module doc), once
    per process for each `stage` of start-up ("import": before the first model is loaded,
    "load": after it): a process that builds a second engine (tests, benchmarks) is past its
    start-up, and would only fault the pages back again. False where nothing was done."""
    if not enabled() or stage in _released:
        return False
    _released.add(stage)
    try:
        with open("/proc/self/maps") as maps:
            text = maps.read()
    except OSError:
        return False
    return page_out(library_mappings(text))


@functools.cache
def _madvise():
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise
