"""The fused C++ ops (engine/kernels/cpu/fused_ops.cpp) give the same bits as the torch chains
they replace, over shapes and dtypes (hypothesis), and the engine's tokens do not change when
they are switched on or off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kernels.cpu import fused_ops
from engine.layers.ops import rotary_torch_

kernels = fused_ops.load()
pytestmark = pytest.mark.skipif(kernels is None, reason="fused ops unavailable (no compiler)")
LANES = fused_ops.lanes() or (8, 0)
REDUCED = [torch.bfloat16, torch.float16]


def norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """engine/layers/norm.py's formula for bf16/fp16 (HF's rounding)."""
    x32 = x.float()
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)


def _randn(shape, dtype, scale, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 70), hidden=st.integers(1, 3000), dtype=st.sampled_from(REDUCED),
    scale=st.sampled_from([1e-3, 1.0, 30.0]), seed=st.integers(0, 2**16),
    eps=st.sampled_from([1e-5, 1e-6]),
)  # fmt: skip
def test_add_rms_norm_is_bit_identical_to_the_torch_formula(rows, hidden, dtype, scale, seed, eps):
    x, residual = (
        _randn((rows, hidden), dtype, scale, seed),
        _randn((rows, hidden), dtype, 1, ~seed),
    )
    weight = _randn((hidden,), dtype, 1, seed + 1)
    out = torch.empty_like(x)
    kernels.rms_norm(x, weight, out, eps, LANES[0])
    assert torch.equal(out, norm_reference(x, weight, eps))
    expected_sum = x + residual
    kernels.add_rms_norm_(x, residual, weight, eps, LANES[0])
    assert torch.equal(residual, expected_sum)
    assert torch.equal(x, norm_reference(expected_sum, weight, eps))


def test_rms_norm_reads_a_strided_x_and_rejects_bad_shapes():
    wide = _randn((4, 128), torch.bfloat16, 1, 0)
    x, weight = wide[:, :64], _randn((64,), torch.bfloat16, 1, 1)
    out = torch.empty(4, 64, dtype=torch.bfloat16)
    kernels.rms_norm(x, weight, out, 1e-5, LANES[0])
    assert torch.equal(out, norm_reference(x, weight, 1e-5))
    with pytest.raises(RuntimeError, match="weight"):
        kernels.rms_norm(x, weight[:32], out, 1e-5, LANES[0])
    with pytest.raises(RuntimeError, match="share a dtype"):
        kernels.rms_norm(x.float(), weight, out, 1e-5, LANES[0])
    with pytest.raises(RuntimeError, match="residual"):
        kernels.add_rms_norm_(x, x, weight, 1e-5, LANES[0])  # a strided residual


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 40), n=st.integers(1, 2000),
    dtype=st.sampled_from([torch.float32, *REDUCED]), seed=st.integers(0, 2**16),
    scale=st.sampled_from([0.1, 4.0, 40.0]),
)  # fmt: skip
def test_silu_mul_is_bit_identical_to_torch(rows, n, dtype, seed, scale):
    gate_up = _randn((rows, 2 * n), dtype, scale, seed)
    out = torch.empty(rows, n, dtype=dtype)
    kernels.silu_mul(gate_up, out, LANES[1])
    assert torch.equal(out, F.silu(gate_up[:, :n]) * gate_up[:, n:])


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.integers(1, 40), heads=st.integers(1, 12), extra=st.integers(0, 6),
    half=st.integers(1, 80), dtype=st.sampled_from([torch.float32, *REDUCED]),
    seed=st.integers(0, 2**16),
)  # fmt: skip
def test_rotary_is_bit_identical_to_torch_and_touches_only_its_heads(
    tokens, heads, extra, half, dtype, seed
):
    head_dim = 2 * half
    qkv = _randn((tokens, heads + extra, head_dim), dtype, 2, seed)
    cos = _randn((tokens, 1, head_dim), dtype, 1, seed + 1)
    sin = _randn((tokens, 1, head_dim), dtype, 1, seed + 2)
    expected = qkv.clone()
    rotary_torch_(expected[:, :heads], cos, sin)
    kernels.rotary_(qkv[:, :heads], cos, sin)
    assert torch.equal(qkv, expected)


def test_rotary_rejects_mismatched_tables():
    x = torch.zeros(3, 2, 8)
    with pytest.raises(RuntimeError, match="cos/sin"):
        kernels.rotary_(x, torch.zeros(2, 8), torch.zeros(2, 8))
    with pytest.raises(RuntimeError, match="even"):
        kernels.rotary_(torch.zeros(3, 2, 7), torch.zeros(3, 7), torch.zeros(3, 7))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_tokens_are_the_same_with_fused_ops_on_and_off(tiny_model_dir, dtype):
    from engine import LLMEngine, SamplingParams

    def generate(mode: str):
        eng = LLMEngine(tiny_model_dir, dtype=dtype, fused_ops=mode, num_kv_blocks=64)
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        for i, prompt in enumerate([[5, 6, 7, 8, 9], [11, 12], [20, 21, 22, 23]]):
            eng.add_request(str(i), prompt, params)
        tokens: dict[str, list[int]] = {}
        while eng.has_unfinished_requests():
            for delta in eng.step():
                tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
        return eng.runner.pointwise_ops, tokens

    fused_names, fused_tokens = generate("on")
    torch_names, torch_tokens = generate("off")
    assert fused_names["rotary"] == fused_names["silu_mul"] == "fused"
    assert set(torch_names.values()) == {"torch"}
    # the norm stays torch's fused F.rms_norm in fp32
    assert fused_names["rms_norm"] == ("torch" if dtype == "float32" else "fused")
    assert fused_tokens == torch_tokens


SPECIAL = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), -float("nan"), 1.0, -1.0]


@settings(max_examples=80, deadline=None)
@given(
    rows=st.integers(1, 9), n=st.integers(1, 700), dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    seed=st.integers(0, 2**16), levels=st.integers(1, 6),
    specials=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(SPECIAL)), max_size=6),
)  # fmt: skip
def test_argmax_rows_gives_torch_max_indices(rows, n, dtype, seed, levels, specials):
    # Few distinct levels make ties common (the first index must win); signed zeros, infinities
    # and NaNs of either sign are planted at random places.
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-levels, levels, (rows, n), generator=g).float().to(dtype)
    for position, value in specials:
        x.view(-1)[position % x.numel()] = value
    assert torch.equal(kernels.argmax_rows(x), x.max(dim=-1).indices)
    wide = torch.zeros(rows, n + 5, dtype=dtype)  # a row stride wider than the row
    wide[:, :n] = x
    assert torch.equal(kernels.argmax_rows(wide[:, :n]), x.max(dim=-1).indices)


def test_argmax_rows_rejects_what_it_cannot_read():
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernels.argmax_rows(torch.zeros(2, 3, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="unit last stride"):
        kernels.argmax_rows(torch.zeros(3, 2).t())
    with pytest.raises(RuntimeError, match="n >= 1"):
        kernels.argmax_rows(torch.zeros(2, 0))


def _runnable_isas() -> list[str]:
    """fused_ops builds this CPU can run: topk_rows has an AVX-512, an AVX2 and a portable path,
    each compiled into its own build."""
    from engine.platform import cpu_info

    order = ["avx512", "avx2", "portable"]
    return order[order.index(cpu_info().vector_isa) :]


@pytest.fixture(scope="module", params=_runnable_isas())
def topk_build(request):
    ext = fused_ops.build(isa=request.param)
    if ext is None:
        pytest.skip(f"no {request.param} build of the fused ops here")
    return ext


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 5), n=st.integers(1, 300), k_share=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16), levels=st.integers(1, 8),
    specials=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(SPECIAL)), max_size=4),
)  # fmt: skip
def test_topk_rows_ranks_by_value_then_index(topk_build, rows, n, k_share, seed, levels, specials):
    """Each row's k largest, value descending and of equal values the lower index first (few
    distinct levels make ties common, across chunks of 16 and past the first 2k kept); signed
    zeros and infinities in place; a row holding a NaN is left to the caller."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-levels, levels, (rows, n), generator=g).float() / levels
    for position, value in specials:
        x.view(-1)[position % x.numel()] = value
    k = max(1, round(k_share * n))
    values, indices, taken = topk_build.topk_rows(x, k)
    for r in range(rows):
        row = x[r].tolist()
        if any(v != v for v in row):
            assert not taken[r]
            continue
        want = sorted(range(n), key=lambda j: (-row[j], j))[:k]
        assert taken[r] and indices[r].tolist() == want
        assert torch.equal(values[r], x[r, want])


def test_topk_rows_rejects_what_it_cannot_read():
    with pytest.raises(RuntimeError, match="float32"):
        kernels.topk_rows(torch.zeros(2, 3, dtype=torch.bfloat16), 1)
    with pytest.raises(RuntimeError, match="k must be"):
        kernels.topk_rows(torch.zeros(2, 3), 4)


def _softmax_reference(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """The sampler's torch chain (engine/sampler.py `_scaled`, then softmax)."""
    return torch.softmax(logits.float().div_(temperatures[:, None]), dim=-1)


@settings(max_examples=80, deadline=None)
@given(
    rows=st.integers(1, 6), n=st.sampled_from([1, 3, 7, 8, 9, 15, 16, 17, 33, 100, 1000, 4099]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16),
    scale=st.sampled_from([0.01, 3.0, 30.0]), temperature=st.floats(0.05, 5.0),
    masked=st.lists(st.integers(0, 10**6), max_size=12),
)  # fmt: skip
def test_softmax_rows_is_bit_identical_to_the_samplers_torch_chain(
    rows, n, dtype, seed, scale, temperature, masked
):
    """softmax(float(logits) / t) row by row, the same bits as the torch chain it replaces in
    the sampler, over row lengths around this dispatch's vector width (partial vectors, rows
    shorter than one), both dtypes, temperatures per row and -inf logits (a grammar's mask)."""
    logits = _randn((rows, n), dtype, scale, seed)
    for position in masked:
        if position % logits.numel() % n:  # keep each row's first logit finite
            logits.view(-1)[position % logits.numel()] = float("-inf")
    temperatures = torch.linspace(temperature, temperature * 1.7, rows)
    probs, done = kernels.softmax_rows(logits, temperatures, LANES[1])
    assert bool(done.all())
    assert torch.equal(probs, _softmax_reference(logits, temperatures))


def test_softmax_rows_reports_rows_it_leaves_to_torch_and_rejects_bad_input():
    logits = torch.zeros(4, 20)
    logits[1, 3] = float("nan")
    logits[2] = float("-inf")
    logits[3, 5] = float("inf")
    probs, done = kernels.softmax_rows(logits, torch.ones(4), LANES[1])
    assert done.tolist() == [True, False, False, False]
    assert torch.equal(probs[0], torch.full((20,), 0.05))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernels.softmax_rows(logits.half(), torch.ones(4), LANES[1])
    with pytest.raises(RuntimeError, match="temperatures"):
        kernels.softmax_rows(logits, torch.ones(3), LANES[1])
    with pytest.raises(RuntimeError, match="lanes"):
        kernels.softmax_rows(logits, torch.ones(4), 4)


_SOFTMAX_SCRIPT = """
import sys, torch
from engine.kernels.cpu import fused_ops
ext = fused_ops.build(isa=sys.argv[1])
lanes = fused_ops.lanes()[1]
same = total = 0
for seed in range(40):
    g = torch.Generator().manual_seed(seed)
    rows, n = 1 + seed % 4, [1, 5, 8, 13, 16, 31, 100, 4099][seed % 8]
    logits = (torch.randn(rows, n, generator=g) * 8).to([torch.float32, torch.bfloat16][seed % 2])
    t = torch.rand(rows, generator=g) + 0.1
    probs, done = ext.softmax_rows(logits, t, lanes)
    ref = torch.softmax(logits.float().div_(t[:, None]), dim=-1)
    same += bool(done.all()) and torch.equal(probs, ref)
    total += 1
logits = torch.randn(3, 100)
logits[1, 9] = float("nan")  # inside a vector, not in the scalar tail
logits[2, 97] = float("nan")  # in the tail
probs, done = ext.softmax_rows(logits, torch.ones(3), lanes)
print(done.tolist() == [True, False, False], lanes, same, total)
"""


@pytest.mark.parametrize("isa,capability,want_lanes", [("avx2", "avx2", 8), ("portable", "default", 0)])
def test_softmax_rows_follows_a_narrower_dispatch(isa, capability, want_lanes):
    """Under torch's AVX2 and DEFAULT dispatch (8 lanes with SLEEF's 8-lane exp; 8 lanes in
    order with std::exp), in a process of its own with that build of the fused ops: the same
    bits as torch's chain there, and rows with a NaN (in a vector or in the tail) left to it."""
    import os
    import subprocess
    import sys

    from engine.platform import cpu_info

    if isa == "avx2" and cpu_info().vector_isa == "portable":
        pytest.skip("this CPU has no AVX2")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    done = subprocess.run(
        [sys.executable, "-c", _SOFTMAX_SCRIPT, isa], env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    nan_rows_left, lanes, same, total = done.stdout.split()[-4:]
    assert (int(lanes), int(same)) == (want_lanes, int(total))
    assert nan_rows_left == "True", "a row with a NaN was not left to torch"
