"""Shared-library pages handed back to the kernel (engine/library_pages.py): which mappings, and
that their pages leave RSS."""

from __future__ import annotations

import mmap
import os
import sys

import pytest

from engine import library_pages
from tests.engine.smaps import mapping_field

MAPS = """\
7f0000000000-7f0000100000 r--p 00000000 08:01 11 /venv/torch/lib/libtorch_cpu.so
7f0000100000-7f0000900000 r-xp 00100000 08:01 11 /venv/torch/lib/libtorch_cpu.so
7f0000900000-7f0000a00000 r--p 00900000 08:01 11 /venv/torch/lib/libtorch_cpu.so
7f0000a00000-7f0000a10000 rw-p 00a00000 08:01 11 /venv/torch/lib/libtorch_cpu.so
7f0001000000-7f0001100000 r-xp 00000000 08:01 12 /usr/lib/libpython3.11.so.1.0
7f0002000000-7f0002100000 r--p 00000000 08:01 13 /models/model.Q4_1.gguf
7f0003000000-7f0003100000 rw-p 00000000 00:00 0
7f0004000000-7f0004100000 r-xp 00000000 08:01 14 /tmp/libgone.so (deleted)
7f0005000000-7f0005001000 r-xp 00000000 08:01 15 /venv/numpy/_core/_umath.cpython-311-x86_64-linux-gnu.so
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0                          [stack]
7ffd00100000-7ffd00102000 r-xp 00000000 00:00 0                          [vdso]
"""


def test_only_the_read_only_mappings_of_shared_libraries_are_chosen() -> None:
    assert list(library_pages.library_mappings(MAPS)) == [
        (0x7F0000000000, 0x7F0000100000),  # libtorch's read-only data, code, relocated data
        (0x7F0000100000, 0x7F0000900000),
        (0x7F0000900000, 0x7F0000A00000),
        (0x7F0001000000, 0x7F0001100000),  # a versioned .so name
        (0x7F0005000000, 0x7F0005001000),  # an extension module
    ]  # not: the writable data, the GGUF, anonymous memory, a deleted file, the stack, the vdso


def _write_clean(path, data: bytes) -> None:
    """Write `path` and flush it to disk, as a library on disk is: the kernel pages out clean
    file pages only, so pages still dirty from the write stay resident until writeback has run
    (a race with the machine's flusher, lost once in a CI rehearsal)."""
    with open(path, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


def _rss_kib_of(address: int) -> int:
    """Rss of the mapping at `address`, in KiB."""
    return int(mapping_field(address, "Rss").split()[0])


def _has_pageout() -> bool:
    """Linux 5.4 or later (MADV_PAGEOUT)."""
    if not sys.platform.startswith("linux"):
        return False
    major, minor = (int(part) for part in os.uname().release.split(".")[:2])
    return (major, minor) >= (5, 4)


NEEDS_PAGEOUT = pytest.mark.skipif(not _has_pageout(), reason="needs Linux 5.4+ (MADV_PAGEOUT)")


@NEEDS_PAGEOUT
def test_a_read_only_file_mapping_leaves_rss_once_paged_out(tmp_path, monkeypatch) -> None:
    """A file of our own (no other process maps its pages, which the kernel would skip), read
    page by page: resident; paged out: not resident; read again: the same bytes, resident."""
    path = tmp_path / "libfake.so"
    data = bytes(range(256)) * (4 << 12)  # 4 MiB
    _write_clean(path, data)
    with open(path, "rb") as file:
        view = mmap.mmap(file.fileno(), 0, prot=mmap.PROT_READ, flags=mmap.MAP_PRIVATE)
    try:
        address = _address_of(str(path))
        assert sum(view[i] for i in range(0, len(view), mmap.PAGESIZE)) >= 0  # every page read
        assert _rss_kib_of(address) >= 4096 - 64
        ranges = [(s, e) for s, e in library_pages.library_mappings(_maps()) if s == address]
        assert ranges, "the fake library's mapping was not chosen"
        assert library_pages.page_out(iter(ranges))
        assert _rss_kib_of(address) < 512
        assert view[:] == data  # faulted back from the file, unchanged
        assert _rss_kib_of(address) >= 4096 - 64
    finally:
        view.close()


def test_it_can_be_switched_off(monkeypatch) -> None:
    monkeypatch.setattr(library_pages, "_released", set())
    monkeypatch.setenv("MINI_INFER_RELEASE_LIBRARY_PAGES", "0")
    assert library_pages.release_library_pages("import") is False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc are Linux's")
def test_each_stage_of_start_up_releases_once_per_process(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(library_pages, "_released", set())
    monkeypatch.setattr(
        library_pages, "page_out", lambda ranges: calls.append(list(ranges)) or True
    )
    monkeypatch.delenv("MINI_INFER_RELEASE_LIBRARY_PAGES", raising=False)
    assert library_pages.release_library_pages("import") is True
    assert library_pages.release_library_pages("import") is False  # a second engine: past it
    assert library_pages.release_library_pages("load") is True
    assert library_pages.release_library_pages("load") is False
    assert len(calls) == 2 and all(calls)  # this process maps libraries: some were chosen


def _maps() -> str:
    with open("/proc/self/maps") as maps:
        return maps.read()


def _address_of(path: str) -> int:
    """Where `path` is mapped in this process (its first mapping)."""
    for line in _maps().splitlines():
        if line.rstrip().endswith(path):
            return int(line.split("-")[0], 16)
    raise AssertionError(f"{path} is not mapped")


@NEEDS_PAGEOUT
def test_a_range_unmapped_meanwhile_does_not_stop_the_others(tmp_path) -> None:
    """/proc/self/maps is read before the madvise calls: a library unloaded in between leaves a
    range with nothing mapped (ENOMEM), and the ranges after it are still paged out."""
    path = tmp_path / "libafter.so"
    _write_clean(path, b"\x01" * (1 << 20))
    with open(path, "rb") as file:
        view = mmap.mmap(file.fileno(), 0, prot=mmap.PROT_READ, flags=mmap.MAP_PRIVATE)
    gone = mmap.mmap(-1, 4 << 20)  # mapped after the file, so the file cannot land in its place
    start = _address_of_anonymous(gone)
    gone.close()  # unmapped: madvise there fails with ENOMEM
    try:
        assert sum(view[i] for i in range(0, len(view), mmap.PAGESIZE)) > 0
        address = _address_of(str(path))
        assert not start <= address < start + (4 << 20)
        assert _rss_kib_of(address) >= 1024 - 64
        ranges = [(start, start + (4 << 20)), (address, address + len(view))]
        assert library_pages.page_out(iter(ranges))
        assert _rss_kib_of(address) < 256
    finally:
        view.close()


def _address_of_anonymous(view: mmap.mmap) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(view))
