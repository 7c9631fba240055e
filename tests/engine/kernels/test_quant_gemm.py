"""The C++ quantized GEMV (engine/kernels/cpu/quant_gemm.cpp) against the dequantizing
reference, every instruction-set path forced in turn.

Tolerances: the kernel sums the same products as the reference (x @ dequantized W^T in fp32)
in another order, so each output may differ by a few fp32 roundings of the sum of |x_k w_k|:
we allow 1e-5 of that sum (the fp32 sums here have at most 512 terms, so a real difference is
below 512 * 2^-24 * 3 ~ 1e-4 of it only in pathological cancellations; a wrong code or a wrong
scale moves an output by about |x_k w_k| / sum, >= 1/512 of it). bf16 outputs are rounded
once from the fp32 result, so add half a bf16 ulp (2^-8 relative) of the reference.
Outputs are written into a NaN-poisoned buffer: an element the kernel forgot stays NaN.

The int8-activation path ("avx512vnni", bf16 inputs) is held to the same bound against the
reference computed on what it makes of the activations (`quant_gemm.quantize_activations`;
int4's minimum term uses the activations as they are, as the kernel does).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kernels.cpu import quant_gemm
from engine.quant.primitives import (
    dequantize_int4,
    dequantize_int8,
    quantize_int4_groupwise,
    quantize_int8_per_channel,
)


@pytest.fixture(scope="module")
def ext():
    module = quant_gemm.load()
    if module is None:
        pytest.skip("the C++ kernel did not build here (no compiler); the layers use torch's")
    return module


def _isa(name: str) -> str:
    if not quant_gemm.can_run(name):
        pytest.skip(f"this CPU lacks {quant_gemm._ISA_FLAGS[name]} for the {name} path")
    return name


ISAS = [pytest.param(name, id=name) for name in quant_gemm.ISAS]


def _check(
    y: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    isa: str = "portable",
    minimum: torch.Tensor | None = None,
) -> None:
    """y against x @ weight^T in fp32, with the bound of the module docstring. `minimum`
    (int4: [out, in], each weight's group minimum) is the part of the weight the
    int8-activation path multiplies with the unquantized activations."""
    x_scaled = x.float()
    if (
        isa in quant_gemm.INT8_ACTIVATION_ISAS
        and x.dtype == torch.bfloat16
        and x.shape[1] % quant_gemm.CHUNK == 0
        and x.shape[0] >= quant_gemm.INT8_ACTIVATION_MIN_ROWS
    ):
        x_scaled = quant_gemm.quantize_activations(x)
    rest = torch.zeros_like(weight) if minimum is None else minimum
    reference = x_scaled @ (weight - rest).t() + x.float() @ rest.t()
    magnitude = x_scaled.abs() @ (weight - rest).abs().t() + x.float().abs() @ rest.abs().t()
    bound = 1e-5 * magnitude + 1e-6
    if y.dtype == torch.bfloat16:
        bound = bound + 2.0**-8 * reference.abs()
    assert y.dtype == x.dtype
    assert torch.isfinite(y).all(), "an output was left unwritten (still NaN)"
    excess = (y.float() - reference).abs() - bound
    assert excess.max() <= 0, f"worst excess over the bound: {excess.max().item()}"


def _spread(minimum: torch.Tensor, group_size: int) -> torch.Tensor:
    """[out, groups] -> [out, in]: each weight's group minimum."""
    return minimum.repeat_interleave(group_size, dim=1)


def _poisoned(rows: int, out_features: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((rows, out_features), float("nan"), dtype=dtype)


dtypes = st.sampled_from([torch.float32, torch.bfloat16])
seeds = st.integers(0, 2**31 - 1)
# An int4 layer's shape: output channels, group size and groups (in_features their product).
INT4_SHAPES = {
    "out_features": st.integers(1, 70),
    "group_size": st.sampled_from([32, 64, 128]),
    "num_groups": st.integers(1, 4),
}


@pytest.mark.parametrize("isa", ISAS)
@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 8), dtype=dtypes, seed=seeds, **INT4_SHAPES)
def test_int4_matches_the_dequantizing_reference(
    ext, isa, rows, out_features, group_size, num_groups, dtype, seed
):
    isa = _isa(isa)
    generator = torch.Generator().manual_seed(seed)
    in_features = group_size * num_groups
    weight = torch.randn(out_features, in_features, generator=generator)
    codes, scale, minimum = quantize_int4_groupwise(weight, group_size)
    packed, scale_min = quant_gemm.pack_int4(codes, scale, minimum)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    y = _poisoned(rows, out_features, dtype)
    result = quant_gemm.int4_gemm(ext, x, packed, scale_min, group_size, out_features, isa, y)
    assert result.data_ptr() == y.data_ptr()
    _check(y, x, dequantize_int4(codes, scale, minimum), isa, _spread(minimum, group_size))


@pytest.mark.parametrize("isa", ISAS)
@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 8),
    out_features=st.integers(1, 70),
    in_features=st.integers(1, 200),
    dtype=dtypes,
    seed=st.integers(0, 2**31 - 1),
)
def test_int8_matches_the_dequantizing_reference(
    ext, isa, rows, out_features, in_features, dtype, seed
):
    isa = _isa(isa)
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator)
    codes, scale = quantize_int8_per_channel(weight)
    packed, packed_scale = quant_gemm.pack_int8(codes, scale)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    y = _poisoned(rows, out_features, dtype)
    quant_gemm.int8_gemm(ext, x, packed, packed_scale, out_features, isa, y)
    _check(y, x, dequantize_int8(codes, scale), isa)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", [9, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_more_rows_than_one_tile_and_extreme_codes(ext, isa, rows, dtype):
    """Row counts past the 8-row (AVX2: 4-row) tile, SmolLM2's widths, and the code extremes
    (int4 0 and 15, int8 -127 and 127) that a wrong nibble or sign extension would break."""
    isa = _isa(isa)
    generator = torch.Generator().manual_seed(rows)
    in_features, out_features = 576, 100
    codes = torch.randint(0, 16, (out_features, in_features), generator=generator)
    codes[:, :64] = torch.tensor([0, 15]).repeat(32)
    codes = codes.to(torch.uint8)
    # fp16 values, as the quantizer makes them (the layout keeps them in fp16)
    scale = (torch.rand(out_features, in_features // 32, generator=generator) * 0.1).half().float()
    minimum = (torch.randn(out_features, in_features // 32, generator=generator) * 0.1).half().float()
    codes8 = torch.randint(-127, 128, (out_features, in_features), generator=generator)
    codes8[:, :64] = torch.tensor([-127, 127]).repeat(32)
    codes8 = codes8.to(torch.int8)
    scale8 = torch.rand(out_features, generator=generator) * 0.01
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    x[0, :32] = 0.0  # an all-zero activation chunk (scale 0 on the int8-activation path)
    y = quant_gemm.int4_gemm(ext, x, *quant_gemm.pack_int4(codes, scale, minimum), 32,
                             out_features, isa)  # fmt: skip
    _check(y, x, dequantize_int4(codes, scale, minimum), isa, _spread(minimum, 32))
    y8 = quant_gemm.int8_gemm(ext, x, *quant_gemm.pack_int8(codes8, scale8), out_features, isa)
    _check(y8, x, dequantize_int8(codes8, scale8), isa)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 4),
    num_chunks=st.integers(1, 6),
    scale=st.sampled_from([1e-3, 1.0, 300.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_the_kernel_quantizes_activations_as_the_reference(ext, rows, num_chunks, scale, seed):
    """The int8-activation paths' codes and scales, exactly: the GEMV tests above build their
    reference on `quantize_activations`, so it must be what the kernel computes (ties at .5
    included: round half to even, and a correctly rounded 127 / max), on each such path."""
    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, num_chunks * quant_gemm.CHUNK, generator=generator) * scale).bfloat16()
    x[0, : quant_gemm.CHUNK] = 0.0
    tried = 0
    for isa in quant_gemm.INT8_ACTIVATION_ISAS:
        if not quant_gemm.can_run(isa):
            continue
        codes, scales = ext.quantize_activations(x, quant_gemm.isa_code(isa))
        assert codes.abs().max() <= 127
        ours = codes.float().reshape(rows, num_chunks, -1) * scales.unsqueeze(-1)
        assert torch.equal(ours.reshape(rows, -1), quant_gemm.quantize_activations(x)), isa
        tried += 1
    if not tried:
        pytest.skip("this CPU runs no int8-activation path")


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 9), seed=seeds, **INT4_SHAPES)
def test_the_avx2_int8_path_has_the_vnni_paths_bits(
    ext, rows, out_features, group_size, num_groups, seed
):
    """avx2_int8 emulates vpdpbusd with vpmaddubsw: the same activation codes, the same exact
    integer sums, each chunk's sum scaled in the same order, so every output has the VNNI
    path's bits (int4 and int8, row counts past the AVX2 tile of 4, extreme codes included)."""
    _isa("avx512vnni")
    _isa("avx2_int8")
    generator = torch.Generator().manual_seed(seed)
    in_features = group_size * num_groups
    weight = torch.randn(out_features, in_features, generator=generator)
    weight[:, :8] = torch.tensor([-9.0, 9.0] * 4)  # codes at both ends of their ranges
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    packed4 = quant_gemm.pack_int4(*quantize_int4_groupwise(weight, group_size))
    packed8 = quant_gemm.pack_int8(*quantize_int8_per_channel(weight))
    for bits, call in (
        (4, lambda isa: quant_gemm.int4_gemm(ext, x, *packed4, group_size, out_features, isa)),
        (8, lambda isa: quant_gemm.int8_gemm(ext, x, *packed8, out_features, isa)),
    ):
        assert torch.equal(call("avx2_int8"), call("avx512vnni")), bits


def test_rows_below_the_minimum_take_the_exact_path_on_the_int8_activation_isa(ext):
    """Below INT8_ACTIVATION_MIN_ROWS the VNNI path hands the call to the exact path of the same
    CPU (the same bits as that path, not the quantized-activation reference's); from it on, it
    quantizes (bits of its own)."""
    _isa("avx512vnni")
    exact = "avx512bf16" if quant_gemm.can_run("avx512bf16") else "avx512"
    generator = torch.Generator().manual_seed(3)
    codes, scale, minimum = quantize_int4_groupwise(torch.randn(48, 128, generator=generator), 32)
    packed4 = quant_gemm.pack_int4(codes, scale, minimum)
    codes8, scale8 = quantize_int8_per_channel(torch.randn(48, 128, generator=generator))
    packed8 = quant_gemm.pack_int8(codes8, scale8)
    for rows in range(1, quant_gemm.INT8_ACTIVATION_MIN_ROWS + 1):
        x = torch.randn(rows, 128, generator=generator).bfloat16()
        same = rows < quant_gemm.INT8_ACTIVATION_MIN_ROWS
        y4 = [quant_gemm.int4_gemm(ext, x, *packed4, 32, 48, isa) for isa in ("avx512vnni", exact)]
        y8 = [quant_gemm.int8_gemm(ext, x, *packed8, 48, isa) for isa in ("avx512vnni", "avx512")]
        assert torch.equal(*y4) == same and torch.equal(*y8) == same


def test_a_strided_input_gives_the_same_result(ext):
    generator = torch.Generator().manual_seed(0)
    codes, scale = quantize_int8_per_channel(torch.randn(40, 64, generator=generator))
    packed = quant_gemm.pack_int8(codes, scale)
    wide = torch.randn(3, 128, generator=generator)
    strided = wide[:, ::2]
    assert not strided.is_contiguous()
    expected = quant_gemm.int8_gemm(ext, strided.contiguous(), *packed, 40)
    assert torch.equal(quant_gemm.int8_gemm(ext, strided, *packed, 40), expected)


def test_bad_arguments_are_refused_with_a_message(ext):
    codes, scale, minimum = quantize_int4_groupwise(torch.randn(20, 64), 32)
    packed, scale_min = quant_gemm.pack_int4(codes, scale, minimum)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="int4 codes must be"):
        quant_gemm.int4_gemm(ext, torch.randn(2, 128), packed, scale_min, 32, 20)
    with pytest.raises(RuntimeError, match="multiple of group_size"):
        quant_gemm.int4_gemm(ext, torch.randn(2, 48), packed, scale_min, 32, 20)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        quant_gemm.int4_gemm(ext, x.half(), packed, scale_min, 32, 20)
    with pytest.raises(RuntimeError, match="out must be"):
        quant_gemm.int4_gemm(ext, x, packed, scale_min, 32, 20, out=torch.empty(2, 21))
    with pytest.raises(ValueError, match="unknown isa"):
        quant_gemm.int4_gemm(ext, x, packed, scale_min, 32, 20, isa="neon")
    with pytest.raises(ValueError, match="bad int8 tensors"):
        quant_gemm.pack_int8(torch.zeros(4, 8, dtype=torch.int8), torch.ones(5))


@pytest.mark.parametrize(
    "flags,fastest,exact",
    [
        ("avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512_vnni avx512vbmi",
         "avx512vnni", "avx512"),
        ("avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512_bf16 avx512_vnni avx512vbmi",
         "avx512vnni", "avx512bf16"),
        ("avx2 fma f16c avx512f avx512bw avx512vl avx512dq", "avx512", "avx512"),
        ("avx2 fma f16c", "avx2_int8", "avx2"),
        ("sse4_2 avx", "portable", "portable"),
    ],
)  # fmt: skip
def test_best_isa_by_cpu(monkeypatch, flags, fastest, exact):
    """The path each kind of CPU takes: int8 activations with VNNI, or with AVX2 where there is
    no AVX-512 (an AVX-512 CPU without VNNI keeps its exact path), and with
    `int8_activations=False` the widest exact path."""
    from engine import platform

    info = platform.CpuInfo("a cpu", frozenset(flags.split()), "DEFAULT")
    monkeypatch.setattr(quant_gemm, "cpu_info", lambda: info)
    quant_gemm.best_isa.cache_clear()
    try:
        assert quant_gemm.best_isa() == fastest
        assert quant_gemm.best_isa(int8_activations=False) == exact
    finally:
        quant_gemm.best_isa.cache_clear()


def test_a_path_this_cpu_cannot_run_is_refused(ext, monkeypatch):
    from engine import platform

    bare = platform.CpuInfo("no-vector-cpu", frozenset(), "DEFAULT")
    monkeypatch.setattr(quant_gemm, "cpu_info", lambda: bare)
    codes, scale = quantize_int8_per_channel(torch.randn(16, 32))
    with pytest.raises(RuntimeError, match="cannot run the avx512 path"):
        quant_gemm.int8_gemm(ext, torch.randn(1, 32), *quant_gemm.pack_int8(codes, scale), 16,
                             isa="avx512")  # fmt: skip
    assert quant_gemm.can_run("portable")


def test_no_compiler_means_no_extension_and_a_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert quant_gemm.build(tmp_path) is None


def test_the_source_is_staged_once_and_restaged_when_it_changes(tmp_path):
    """Builds compile a copy of the source inside the build directory, rewritten only when the
    source differs (a rewrite would make ninja rebuild)."""
    import os

    from engine.kernels.cpu.extension import _staged

    source = tmp_path / "kernel.cpp"
    source.write_text("int a;\n")
    build_dir = tmp_path / "build"
    build_dir.mkdir()
    staged = _staged(source, build_dir)
    assert staged.parent == build_dir and staged.read_text() == "int a;\n"
    os.utime(staged, (1, 1))
    _staged(source, build_dir)
    assert staged.stat().st_mtime == 1  # unchanged source: the copy is left alone
    source.write_text("int b;\n")
    _staged(source, build_dir)
    assert staged.read_text() == "int b;\n"


def test_a_local_header_is_staged_and_hashed_with_its_source(tmp_path):
    """A header included by quotes from the source's folder is copied beside the staged source
    and is part of its digest: a changed header names (and builds) another library; a header
    included by angle brackets or from another folder is not ours to stage."""
    from engine.kernels.cpu.extension import _staged, build_inputs, source_digest

    source = tmp_path / "kernel.cpp"
    header = tmp_path / "helper.h"
    header.write_text("int h = 1;\n")
    source.write_text(
        '#include <vector>\n  #  include "helper.h"\n#include "../other/x.h"\n'
        '#include "helper.h"\nint a;\n'
    )
    assert build_inputs(source) == [source, header]
    build_dir = tmp_path / "build"
    build_dir.mkdir()
    _staged(source, build_dir)
    assert (build_dir / "helper.h").read_text() == "int h = 1;\n"
    before = source_digest(source)
    header.write_text("int h = 2;\n")
    assert source_digest(source) != before
    _staged(source, build_dir)
    assert (build_dir / "helper.h").read_text() == "int h = 2;\n"
    plain = tmp_path / "plain.cpp"
    plain.write_text("int a;\n")
    assert build_inputs(plain) == [plain]


def test_a_prebuilt_library_is_stale_when_its_header_changed(tmp_path):
    """The prebuilt check compares the staged header too: with it unchanged the library is
    loaded (here an empty file, which fails to load and says so); changed, it is not tried."""
    from structlog.testing import capture_logs

    from engine.kernels.cpu import extension

    source = tmp_path / "kernel.cpp"
    header = tmp_path / "helper.h"
    header.write_text("int h = 1;\n")
    source.write_text('#include "helper.h"\nint a;\n')
    directory = tmp_path / "build"
    directory.mkdir()
    extension._staged(source, directory)
    library = directory / "kernel.so"
    library.write_bytes(b"")
    extension._write_stamp(directory, library, ["-O3"])
    with capture_logs() as logs:
        assert extension._import_prebuilt("kernel", source, directory, ["-O3"]) is None
    assert [entry["event"] for entry in logs] == ["extension.prebuilt_unloadable"]
    header.write_text("int h = 2;\n")
    with capture_logs() as logs:
        assert extension._import_prebuilt("kernel", source, directory, ["-O3"]) is None
    assert logs == []


_PREFETCH_PROBE = """
import hashlib, torch
from engine.kernels.cpu import quant_gemm as qg
torch.manual_seed(0)
codes = torch.randint(0, 16, (64, 256), dtype=torch.uint8)
packed, sm = qg.pack_int4(codes, torch.rand(64, 8) * 0.01, -torch.rand(64, 8) * 0.1)
i8, s8 = qg.pack_int8(torch.randint(-127, 128, (64, 256), dtype=torch.int8), torch.rand(64))
x = torch.randn(3, 256).bfloat16()
out = [qg.int4_gemm(qg.load(), x, packed, sm, 32, 64), qg.int8_gemm(qg.load(), x, i8, s8, 64)]
if qg.can_run("avx512"):  # the exact int8 path prefetches too
    out.append(qg.int8_gemm(qg.load(), x, i8, s8, 64, isa="avx512"))
from engine.kernels.cpu import bf16_gemm as bg
for isa in bg.ISAS:  # every bf16 path this CPU runs (the AVX-512 one prefetches)
    if bg.can_run(isa):
        out.append(bg.gemm(bg.load(), x, bg.pack(torch.randn(64, 256)), None, 64, isa))
from engine.kernels.cpu import decode_step as ds
screen = bg.pack_screen(torch.randint(-127, 128, (64, 256), dtype=torch.int8))
scales = torch.rand(64)  # (the task keeps pointers: alive until it has run)
for isa in bg.SCREEN_ISAS:  # a bf16 lm_head's screen GEMV (the AVX-512 ones prefetch)
    if bg.can_run(isa) and ds.load() is not None:
        y = torch.empty(3, 64, dtype=torch.bfloat16)
        args, n = bg.load().make_screen_gemv_task(x, y, screen, scales, 64,
                                                  bg.screen_isa_code(isa))
        ds.load().Plan([(bg.load().screen_gemv_task_fn(), args, n, 0, True)]).run(3, 1, ds.SPIN)
        out.append(y)
print(hashlib.sha256(b"".join(t.float().numpy().tobytes() for t in out)).hexdigest())
"""


def test_the_prefetch_distance_changes_no_bits(ext):
    """MINI_INFER_GEMV_PREFETCH_BYTES (read once per process; quant_gemm's VNNI paths and
    exact AVX-512 int8 one, bf16_gemm's AVX-512 one and its screen's) only moves memory traffic: off,
    a short or a long distance, garbage (none) and the default give the same outputs."""
    import os
    import subprocess
    import sys

    digests = set()
    for value in ("0", "64", "65536", "abc", None):
        env = {k: v for k, v in os.environ.items() if k != "MINI_INFER_GEMV_PREFETCH_BYTES"}
        if value is not None:
            env["MINI_INFER_GEMV_PREFETCH_BYTES"] = value
        run = subprocess.run(
            [sys.executable, "-c", _PREFETCH_PROBE], env=env, capture_output=True, text=True,
            timeout=120, check=True,
        )  # fmt: skip
        digests.add(run.stdout.strip().splitlines()[-1])
    assert len(digests) == 1


def _rows_alike_case(ext, isa: str, bits: int, x: torch.Tensor, codes, scale, minimum=None):
    """(rows computed together, each row computed alone) on path `isa`."""
    out_features = codes.shape[0]
    if bits == 4:
        packed = quant_gemm.pack_int4(codes, scale, minimum)
        run = lambda rows: quant_gemm.int4_gemm(ext, rows, *packed, 32, out_features, isa)  # noqa: E731
    else:
        packed = quant_gemm.pack_int8(codes, scale)
        run = lambda rows: quant_gemm.int8_gemm(ext, rows, *packed, out_features, isa)  # noqa: E731
    together = run(x)
    alone = torch.cat([run(x[r : r + 1].clone()) for r in range(x.shape[0])])
    return together, alone


@pytest.mark.parametrize("isa", ISAS)
@settings(max_examples=20, deadline=None)
@given(
    rows=st.integers(2, 8),
    bits=st.sampled_from([4, 8]),
    num_groups=st.integers(1, 6),
    seed=st.integers(0, 2**31 - 1),
)
def test_rows_alike_rows_get_the_bits_of_the_row_alone(ext, isa, rows, bits, num_groups, seed):
    """Speculative decoding verifies proposals as extra rows of one step and needs each row's
    bits to be its one-row step's (engine/fused_decode.py `speculate`): up to
    `quant_gemm.rows_alike` rows, every row of a call equals that row computed alone. bf16
    activations, as the fused step has them; widths of whole chunks of 32 or not."""
    isa = _isa(isa)
    generator = torch.Generator().manual_seed(seed)
    in_features = 32 * num_groups
    limit = quant_gemm.rows_alike(quant_gemm.isa_code(isa), in_features)
    rows = min(rows, limit)
    weight = torch.randn(40, in_features, generator=generator)
    x = torch.randn(rows, in_features, generator=generator).to(torch.bfloat16)
    if bits == 4:
        quantized = quantize_int4_groupwise(weight, 32)
    else:
        quantized = quantize_int8_per_channel(weight)
    together, alone = _rows_alike_case(ext, isa, bits, x, *quantized)
    assert torch.equal(together, alone), (isa, rows)


@pytest.mark.parametrize(
    ("bits", "rows"), [(4, 5), (4, 6), (4, 9), (4, 33), (8, 15), (8, 16), (8, 33)]
)
@pytest.mark.parametrize("group_size", [32, 64])
def test_the_avx2_int8_path_for_many_rows_has_the_bits_of_its_few_rows_path(
    ext, bits, rows, group_size
):
    """From 6 rows (int4) and 16 (int8) the AVX2 int8-activation path rearranges each block's
    codes once for all its row tiles (quant_gemm.cpp `int4_block_avx2_int8<R, true>`,
    `int8_block_avx2_int8<R, true>`); below, each tile reads them as they are packed. Both sum
    the same integers and scale them in the same order: every row of a many-row call has the
    bits of that row computed alone (SmolLM2's width, codes at both ends of their range, an
    all-zero activation chunk)."""
    _isa("avx2_int8")
    generator = torch.Generator().manual_seed(rows * group_size + bits)
    in_features = 576
    x = torch.randn(rows, in_features, generator=generator).to(torch.bfloat16)
    x[rows // 2, 32:64] = 0.0
    if bits == 4:
        codes = torch.randint(0, 16, (100, in_features), generator=generator)
        codes[:, :64] = torch.tensor([0, 15]).repeat(32)
        groups = in_features // group_size
        scale = (torch.rand(100, groups, generator=generator) * 0.1).half().float()
        minimum = (torch.randn(100, groups, generator=generator) * 0.1).half().float()
        packed = quant_gemm.pack_int4(codes.to(torch.uint8), scale, minimum)
        run = lambda x: quant_gemm.int4_gemm(ext, x, *packed, group_size, 100, "avx2_int8")  # noqa: E731
    else:
        codes = torch.randint(-127, 128, (100, in_features), generator=generator)
        codes[:, :64] = torch.tensor([-127, 127]).repeat(32)
        codes[:, 64:96] = 0
        packed = quant_gemm.pack_int8(codes.to(torch.int8), torch.rand(100, generator=generator))
        run = lambda x: quant_gemm.int8_gemm(ext, x, *packed, 100, "avx2_int8")  # noqa: E731
    together = run(x)
    alone = torch.cat([run(x[r : r + 1].clone()) for r in range(rows)])
    assert torch.equal(together, alone)


@pytest.mark.parametrize("isa", ISAS)
def test_past_rows_alike_the_grouping_of_the_sums_shows(ext, isa):
    """The limit is where the paths' sums regroup: with products 2^24, 1, -2^24, 1 (repeated),
    the exact AVX-512 and AVX2 paths sum a row otherwise at 3 rows than at 1 (their
    accumulators per row go from 4 to 2), so `rows_alike` says 2 for them; the portable and
    int8-activation paths keep a row's bits at every count tried."""
    isa = _isa(isa)
    in_features = 64
    x = torch.tensor([2.0**24, 1.0, -(2.0**24), 1.0] * 16, dtype=torch.bfloat16).repeat(8, 1)
    codes = torch.ones(16, in_features, dtype=torch.int8)
    limit = quant_gemm.rows_alike(quant_gemm.isa_code(isa), in_features)
    for rows in range(1, 9):
        together, alone = _rows_alike_case(ext, isa, 8, x[:rows], codes, torch.ones(16))
        if rows <= limit:
            assert torch.equal(together, alone), (isa, rows)
    if limit < 8:
        together, alone = _rows_alike_case(ext, isa, 8, x[: limit + 1], codes, torch.ones(16))
        assert not torch.equal(together, alone), f"{isa}: rows_alike could be higher"


def _group_sums_reference(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """group_sums' order in fp32 (numpy float32 scalars: one IEEE rounding per addition): eight
    running sums over each group's inputs in order, then ((s0 + s1) + (s2 + s3)) + ((s4 + s5)
    + (s6 + s7))."""
    import numpy as np

    values = x.float().numpy()
    rows, k = values.shape
    out = np.zeros((rows, k // group_size), dtype=np.float32)
    for r in range(rows):
        for g in range(k // group_size):
            s = [np.float32(0.0)] * 8
            for i in range(0, group_size, 8):
                for j in range(8):
                    s[j] = np.float32(s[j] + values[r, g * group_size + i + j])
            pairs = [np.float32(s[2 * j] + s[2 * j + 1]) for j in range(4)]
            out[r, g] = np.float32(
                np.float32(pairs[0] + pairs[1]) + np.float32(pairs[2] + pairs[3])
            )
    return torch.from_numpy(out)


@pytest.mark.parametrize("isa", ISAS)
@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 3),
    group_size=st.sampled_from([32, 64, 128]),
    num_groups=st.integers(1, 3),
    dtype=dtypes,
    seed=seeds,
)
def test_every_path_sums_the_int4_groups_in_group_sums_order(
    ext, isa, rows, group_size, num_groups, dtype, seed
):
    """The int4 minimum's term multiplies each group's activation sum: the VNNI path makes them
    while it quantizes the activations, the others in a pass of their own, and every path must
    give group_sums' bits (magnitudes 1e-3 to 1e6 in one group, so that another order of the
    additions shows; signed zeros included)."""
    _isa(isa)
    generator = torch.Generator().manual_seed(seed)
    k = group_size * num_groups
    magnitudes = 10.0 ** (torch.rand(rows, k, generator=generator) * 9 - 3)
    x = (torch.randn(rows, k, generator=generator) * magnitudes).to(dtype)
    x[0, :8] = -0.0
    sums = ext.activation_group_sums(x, group_size, quant_gemm.isa_code(isa))
    expected = _group_sums_reference(x, group_size)
    assert torch.equal(sums.view(torch.int32), expected.view(torch.int32))
