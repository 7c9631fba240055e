"""engine/huge_pages.py: packed weights copied into huge-page-advised chunks, values intact."""

from __future__ import annotations

import pytest
import torch

from engine import huge_pages


@pytest.mark.parametrize(
    ("dtype", "shape"),
    [(torch.uint8, (3, 5, 16)), (torch.float16, (7, 2, 16)), (torch.bfloat16, (1,)),
     (torch.float32, (4, 1000))],
)  # fmt: skip
def test_adopted_tensors_keep_their_values_and_lie_in_the_arena(dtype, shape):
    tensor = (torch.rand(shape) * 100).to(dtype)
    adopted = huge_pages.adopt(tensor, on=True)
    assert adopted.dtype == dtype and adopted.shape == tensor.shape and adopted.is_contiguous()
    assert torch.equal(adopted, tensor) and adopted.data_ptr() != tensor.data_ptr()
    assert adopted.data_ptr() % huge_pages.ALIGN == 0


def test_chunks_pack_small_tensors_and_give_large_ones_their_own_mapping():
    arena = huge_pages.Arena(chunk_bytes=4 * huge_pages.HUGE_PAGE_BYTES)
    a = arena.empty((100,), torch.uint8)
    b = arena.empty((10,), torch.float32)
    assert b.data_ptr() - a.data_ptr() == 128  # the next cache line after a's 100 bytes
    a.fill_(1), b.fill_(2.0)  # disjoint: writing one leaves the other
    assert int(a.sum()) == 100 and float(b.sum()) == 20.0
    big = arena.empty((3 * huge_pages.HUGE_PAGE_BYTES,), torch.uint8)  # over half a chunk
    c = arena.empty((10,), torch.uint8)
    assert c.data_ptr() - a.data_ptr() == 128 + 64  # the chunk goes on after b, not after big
    assert not (a.data_ptr() <= big.data_ptr() < a.data_ptr() + arena.chunk_bytes)
    half = arena.empty((arena.chunk_bytes // 2,), torch.uint8)  # still fits after c
    assert half.data_ptr() - a.data_ptr() == 256
    rest = arena.empty((arena.chunk_bytes // 2,), torch.uint8)  # does not: a new chunk
    assert not (a.data_ptr() <= rest.data_ptr() < a.data_ptr() + arena.chunk_bytes)


def test_off_leaves_tensors_where_they_are(monkeypatch):
    tensor = torch.arange(10)
    assert huge_pages.adopt(tensor, on=False) is tensor
    monkeypatch.setenv("MINI_INFER_HUGE_PAGES", "0")
    huge_pages.enabled.cache_clear()
    try:
        assert not huge_pages.enabled()
        assert huge_pages.adopt(tensor) is tensor
        monkeypatch.setenv("MINI_INFER_HUGE_PAGES", "1")
        huge_pages.enabled.cache_clear()
        assert huge_pages.enabled() == hasattr(__import__("mmap"), "MADV_HUGEPAGE")
    finally:
        huge_pages.enabled.cache_clear()
