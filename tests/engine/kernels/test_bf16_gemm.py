"""The C++ bf16 GEMV / small GEMM (engine/kernels/cpu/bf16_gemm.cpp) against torch, every
instruction-set path forced in turn.

Tolerances: the kernel and torch's bf16 `F.linear` both sum exact bf16 x bf16 products in fp32
(in different orders) and round the result to bf16 once. Against the fp32 reference
x.float() @ w.float().T (+ b) an output may differ by that final rounding (half a bf16 ulp,
2^-9 of |reference|, allowed 2^-8) plus fp32 summation error (allowed 1e-5 of sum |x_k w_k|:
far below what a wrong weight or a missed pair would move, >= 1/K of that sum). Against torch's
bf16 `F.linear` the two roundings may land on neighbouring bf16 values: one ulp (2^-7 relative)
plus the same summation term. Outputs go into a NaN-poisoned buffer: an element the kernel
forgot stays NaN.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kernels.cpu import bf16_gemm


@pytest.fixture(scope="module")
def ext():
    module = bf16_gemm.load()
    if module is None:
        pytest.skip("the C++ kernel did not build here (no compiler); the layers use oneDNN")
    return module


def _isa(name: str) -> str:
    if not bf16_gemm.can_run(name):
        pytest.skip(f"this CPU cannot run the {name} path")
    return name


ISAS = [pytest.param(name, id=name) for name in bf16_gemm.ISAS]


def _bounds(x, weight, bias, y):
    reference = x.float() @ weight.float().t()
    if bias is not None:
        reference = reference + bias.float()
    magnitude = x.float().abs() @ weight.float().abs().t() + 1e-6
    if bias is not None:
        magnitude = magnitude + bias.float().abs()
    assert y.dtype == torch.bfloat16
    assert torch.isfinite(y).all(), "an output was left unwritten (still NaN)"
    return reference, magnitude


def _check(y, x, weight, bias):
    """y against the fp32 reference and against torch's bf16 F.linear (module docstring)."""
    reference, magnitude = _bounds(x, weight, bias, y)
    excess = (y.float() - reference).abs() - (1e-5 * magnitude + 2.0**-8 * reference.abs())
    assert excess.max() <= 0, f"worst excess over the fp32 bound: {excess.max().item()}"
    torch_y = F.linear(x, weight, bias).float()
    excess = (y.float() - torch_y).abs() - (1e-5 * magnitude + 2.0**-7 * torch_y.abs())
    assert excess.max() <= 0, f"worst excess over the F.linear bound: {excess.max().item()}"


def _case(generator, rows, in_features, out_features, has_bias):
    weight = torch.randn(out_features, in_features, generator=generator).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=generator).to(torch.bfloat16) if has_bias else None
    x = torch.randn(rows, in_features, generator=generator).to(torch.bfloat16)
    return x, weight, bias


# A GEMM problem: rows (given per test), widths, a bias or not, the values' seed.
PROBLEM = {
    "in_features": st.integers(1, 300),
    "out_features": st.integers(1, 80),
    "has_bias": st.booleans(),
    "seed": st.integers(0, 2**31 - 1),
}


@pytest.mark.parametrize("isa", ISAS)
@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 16), **PROBLEM)
def test_matches_torch_for_every_shape_row_count_and_bias(
    ext, isa, rows, in_features, out_features, has_bias, seed
):
    isa = _isa(isa)
    x, weight, bias = _case(torch.Generator().manual_seed(seed), rows, in_features,
                            out_features, has_bias)  # fmt: skip
    y = torch.full((rows, out_features), float("nan"), dtype=torch.bfloat16)
    result = bf16_gemm.gemm(ext, x, bf16_gemm.pack(weight), bias, out_features, isa, y)
    assert result.data_ptr() == y.data_ptr()
    _check(y, x, weight, bias)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", [1, 17, 40])
def test_real_widths_and_more_rows_than_one_tile(ext, isa, rows):
    """SmolLM2's widths (several threads share the blocks) and row counts past the 16-row
    (AVX2: 4-row) tile."""
    isa = _isa(isa)
    x, weight, bias = _case(torch.Generator().manual_seed(rows), rows, 576, 1000, True)
    _check(bf16_gemm.gemm(ext, x, bf16_gemm.pack(weight), bias, 1000, isa), x, weight, bias)


# Rows per tile of each path (bf16_gemm.cpp's `run_blocks`): a tile's rows are summed together,
# and the AVX2 path lays its activations out tile by tile (`widen_tiles`). From WIDE_MIN_ROWS
# rows the avx512bf16 path takes tiles of WIDE_ROWS rows over two blocks at once.
TILE_ROWS = {"avx512bf16": 16, "avx512": 16, "avx2": 4, "portable": 1}
WIDE_MIN_ROWS, WIDE_ROWS = 32, 8


def _tile_rows(isa: str, rows: int) -> int:
    return WIDE_ROWS if isa == "avx512bf16" and rows >= WIDE_MIN_ROWS else TILE_ROWS[isa]


@pytest.mark.parametrize("isa", ISAS)
@settings(max_examples=20, deadline=None)
@given(rows=st.integers(2, 80), **PROBLEM)
def test_every_tile_gets_the_bits_of_its_rows_alone(
    ext, isa, rows, in_features, out_features, has_bias, seed
):
    """Many rows are tiles of rows, each computed as a call with those rows alone would: the
    same bits, tile by tile. A tile that read another tile's activations (a wrong offset or
    stride in the tiled layout) would not, nor would the avx512bf16 path's two-block tiles if
    they summed other than one block's (a call of 8 rows alone takes the one-block kernel), or
    wrote a block's outputs into its neighbour's (out_features draws odd numbers of blocks)."""
    isa = _isa(isa)
    x, weight, bias = _case(torch.Generator().manual_seed(seed), rows, in_features,
                            out_features, has_bias)  # fmt: skip
    packed = bf16_gemm.pack(weight)
    together = bf16_gemm.gemm(ext, x, packed, bias, out_features, isa)
    tile = _tile_rows(isa, rows)
    for r0 in range(0, rows, tile):
        alone = bf16_gemm.gemm(ext, x[r0 : r0 + tile].clone(), packed, bias, out_features, isa)
        assert torch.equal(together[r0 : r0 + tile], alone), (isa, r0)


@pytest.mark.parametrize("isa", ISAS)
@settings(max_examples=15, deadline=None)
@given(rows=st.integers(2, bf16_gemm.ROWS_ALIKE), **PROBLEM)
def test_up_to_three_rows_each_get_the_bits_of_the_row_alone(
    ext, isa, rows, in_features, out_features, has_bias, seed
):
    """Speculative decoding verifies up to ROWS_ALIKE (3) rows in one step and needs each row's
    bits to be its one-row step's (engine/fused_decode.py `rows_alike`): on every path a row's
    sums are the same at 1 to ROWS_ALIKE rows."""
    isa = _isa(isa)
    x, weight, bias = _case(torch.Generator().manual_seed(seed), rows, in_features,
                            out_features, has_bias)  # fmt: skip
    _check_rows_alone(ext, isa, x, weight, bias)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", range(2, bf16_gemm.ROWS_ALIKE + 1))
def test_rows_alone_where_the_grouping_of_the_sums_shows(ext, isa, rows):
    """Random products hide a different grouping of the fp32 sums under the bf16 rounding;
    these do not: pairs of 2^25, 1, -2^25, 1 (x all ones) sum to 1, 8 or 16 depending on how
    the pairs are shared among accumulators (the AVX-512 paths give 16 at 4 rows against 8 at
    one: checked, so 4 verification rows would not keep a row's bits)."""
    isa = _isa(isa)
    in_features = 64
    weight = torch.zeros(16, in_features)
    for pair in range(in_features // 2):
        weight[:, 2 * pair] = (2.0**25, 1.0, -(2.0**25), 1.0)[pair % 4]
    x = torch.ones(rows, in_features, dtype=torch.bfloat16)
    _check_rows_alone(ext, isa, x, weight.to(torch.bfloat16), None)


def _check_rows_alone(ext, isa, x, weight, bias):
    out_features = weight.shape[0]
    packed = bf16_gemm.pack(weight)
    together = bf16_gemm.gemm(ext, x, packed, bias, out_features, isa)
    for r in range(x.shape[0]):
        alone = bf16_gemm.gemm(ext, x[r : r + 1].clone(), packed, bias, out_features, isa)
        assert torch.equal(together[r : r + 1], alone), (isa, r)


@settings(max_examples=20, deadline=None)
@given(
    out_features=st.integers(1, 70),
    in_features=st.integers(1, 70),
    seed=st.integers(0, 2**31 - 1),
)
def test_pack_round_trips(out_features, in_features, seed):
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))
    weight = weight.to(torch.bfloat16)
    packed = bf16_gemm.pack(weight)
    assert packed.shape == (-(-out_features // 16), -(-in_features // 2), 16, 2)
    assert torch.equal(bf16_gemm.unpack(packed, out_features, in_features), weight)


def test_a_strided_input_gives_the_same_result(ext):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 64, generator=generator).to(torch.bfloat16)
    packed = bf16_gemm.pack(weight)
    strided = torch.randn(3, 128, generator=generator).to(torch.bfloat16)[:, ::2]
    assert not strided.is_contiguous()
    expected = bf16_gemm.gemm(ext, strided.contiguous(), packed, None, 40)
    assert torch.equal(bf16_gemm.gemm(ext, strided, packed, None, 40), expected)


def test_bad_input_is_a_clear_error(ext):
    weight = torch.randn(40, 64).to(torch.bfloat16)
    packed = bf16_gemm.pack(weight)
    x = torch.randn(2, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="packed weight"):
        bf16_gemm.gemm(ext, torch.randn(2, 66).to(torch.bfloat16), packed, None, 40)
    with pytest.raises(RuntimeError, match="bfloat16"):
        bf16_gemm.gemm(ext, x.float(), packed, None, 40)
    with pytest.raises(RuntimeError, match="bias"):
        bf16_gemm.gemm(ext, x, packed, torch.zeros(7, dtype=torch.bfloat16), 40)
    with pytest.raises(RuntimeError, match="out must be"):
        bf16_gemm.gemm(ext, x, packed, None, 40, out=torch.empty(2, 41, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="unknown isa"):
        bf16_gemm.gemm(ext, x, packed, None, 40, isa="sse9")
    assert bf16_gemm.gemm(ext, x[:0], packed, None, 40).shape == (0, 40)


def test_huge_page_packing_holds_the_same_layout(ext):
    """A weight over one huge page, packed into madvise'd memory: same values, same results,
    and the memory lives as long as the tensor (the mapping is released with it)."""
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(1100, 1001, generator=generator).to(torch.bfloat16)  # ~2.2 MB
    packed = bf16_gemm.pack(weight, huge_pages=True)
    assert packed.is_contiguous()
    assert torch.equal(packed, bf16_gemm.pack(weight, huge_pages=False))
    x = torch.randn(3, 1001, generator=generator).to(torch.bfloat16)
    _check(bf16_gemm.gemm(ext, x, packed, None, 1100), x, weight, None)
    small = torch.randn(20, 30, generator=generator).to(torch.bfloat16)
    assert torch.equal(bf16_gemm.pack(small, huge_pages=True), bf16_gemm.pack(small))
