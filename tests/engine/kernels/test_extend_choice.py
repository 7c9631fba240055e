"""The extend kernel's limit on this machine (engine/kernels/cpu/extend_choice.py): the decision
from timings, a calibration on real kernels that runs and stays consistent with its own timings,
the cache (read back, keyed by shape, not written from a busy machine), and the backend taking
it: chunks up to the limit through the kernel, longer ones through the reference."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.attention_types import PrefillChunk
from engine.kernels.cpu import calibration, extend_choice, paged_attention
from engine.layers.cpu_attention import CpuPagedAttention

kernels = paged_attention.load()
pytestmark = pytest.mark.skipif(kernels is None, reason="C++ kernels unavailable (no compiler)")


def test_decide_keeps_the_sizes_before_the_first_loss():
    decide = extend_choice.decide
    assert decide({1: [10, 5], 4: [10, 9], 16: [10, 11], 64: [10, 5]}) == 4
    assert decide({1: [10, 11], 4: [10, 5]}) == 0
    assert decide({1: [10, 10], 4: [10, 5], 256: [1, 0.5]}) == extend_choice.NO_LIMIT
    assert decide({}) == extend_choice.NO_LIMIT


def test_limits_print_no_limit_as_any():
    limits = extend_choice.ExtendLimits(long=64, short=extend_choice.NO_LIMIT)
    assert repr(limits) == "ExtendLimits(long=64, short=any)"
    assert str(extend_choice.ExtendLimits(0, 4)) == "ExtendLimits(long=0, short=4)"


def test_calibration_times_both_sides_and_decides_from_them():
    backend = CpuPagedAttention(kernels)

    def reference(q, kv_cache, chunk):
        return backend._prefill(q, None, kv_cache, chunk)

    for prefix in (extend_choice.CALIBRATION_PREFIX, extend_choice.SHORT_PREFIX):
        result = extend_choice.calibrate(kernels, reference, 4, 2, 16, 16, torch.float32, prefix)
        times = {int(k): v for k, v in result["us"].items()}
        assert list(times) == list(extend_choice.CALIBRATION_NEW_TOKENS[: len(times)])
        assert all(r > 0 and k > 0 for r, k in times.values())
        assert result["limit"] == extend_choice.decide(times)


def test_the_limit_is_cached_per_shape_and_not_from_a_busy_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("MINI_INFER_CACHE_DIR", str(tmp_path))
    calls = []

    def fake_calibrate(kernels, reference, *shape, prefix=extend_choice.CALIBRATION_PREFIX):
        calls.append(shape)
        return {"limit": 16 if prefix == extend_choice.CALIBRATION_PREFIX else 64,
                "us": {1: [2.0, 1.0]}}  # fmt: skip

    limits = extend_choice.ExtendLimits(long=16, short=64)
    monkeypatch.setattr(extend_choice, "calibrate", fake_calibrate)
    monkeypatch.setattr(calibration, "busy_reason", lambda: "load average 9.0 above 2 cores")
    limit = extend_choice.extend_limit(None, None, 9, 3, 64, 16, torch.bfloat16)
    assert limit == limits and len(calls) == 2  # the long context, then the short one
    assert not extend_choice.calibration_file().exists()  # busy: used, not kept
    monkeypatch.setattr(calibration, "busy_reason", lambda: None)
    assert extend_choice.extend_limit(None, None, 9, 3, 64, 16, torch.bfloat16) == limits
    assert extend_choice.extend_limit(None, None, 9, 3, 64, 16, torch.bfloat16) == limits
    assert len(calls) == 4  # measured again once, then read from the file
    assert extend_choice.extend_limit(None, None, 8, 2, 64, 16, torch.bfloat16) == limits
    assert len(calls) == 6  # another shape: its own entry


def test_a_chunk_takes_the_limit_of_its_context():
    """After at most SHORT_CONTEXT_MAX cached tokens the short context's limit, past it the
    long one's (the reference's per-chunk cost weighs more after a short prefix)."""
    limits = extend_choice.ExtendLimits(long=4, short=64)
    edge = extend_choice.SHORT_CONTEXT_MAX
    assert limits.for_context(0) == limits.for_context(edge) == 64
    assert limits.for_context(edge + 1) == limits.for_context(5000) == 4
    ids = torch.zeros(4, dtype=torch.int64)
    rule = paged_attention.use_extend_kernel
    assert rule(PrefillChunk(0, 22, 32, ids), torch.bfloat16, limits)
    assert not rule(PrefillChunk(0, 65, 32, ids), torch.bfloat16, limits)
    assert rule(PrefillChunk(0, 4, 1024, ids), torch.bfloat16, limits)
    assert not rule(PrefillChunk(0, 22, 1024, ids), torch.bfloat16, limits)


@pytest.mark.parametrize("limit", [0, 4, extend_choice.NO_LIMIT])
def test_the_backend_sends_chunks_up_to_the_limit_to_the_kernel(monkeypatch, limit):
    backend = CpuPagedAttention(kernels)
    limits = extend_choice.ExtendLimits(limit, limit)  # the chunks below follow 20 tokens
    monkeypatch.setattr(extend_choice, "extend_limit", lambda *args: limits)
    backend.calibrate(4, 2, 16, 16, torch.float32)
    assert backend.extend_limit == limits
    seen = {"kernel": [], "reference": []}
    monkeypatch.setattr(
        paged_attention, "extend",
        lambda ext, q, cache, chunks, out: seen["kernel"].extend(c.num_tokens for c in chunks),
    )  # fmt: skip
    monkeypatch.setattr(
        CpuPagedAttention.__mro__[1], "_prefills",
        lambda self, q, kv, cache, chunks, out: seen["reference"].extend(
            c.num_tokens for c in chunks
        ),
    )  # fmt: skip
    ids = torch.zeros(4, dtype=torch.int64)
    chunks = [PrefillChunk(0, 1, 20, ids), PrefillChunk(1, 4, 20, ids), PrefillChunk(5, 5, 20, ids),
              PrefillChunk(10, 7, 0)]  # fmt: skip
    backend._prefills(torch.zeros(17, 4, 16), None, None, chunks, None)
    want_kernel = [n for n in (1, 4, 5) if n <= limit]
    assert seen["kernel"] == want_kernel
    assert sorted(seen["reference"]) == sorted([n for n in (1, 4, 5) if n > limit] + [7])


def test_a_dtype_without_the_kernel_is_not_calibrated(monkeypatch):
    backend = CpuPagedAttention(kernels)
    monkeypatch.setattr(extend_choice, "extend_limit", lambda *args: pytest.fail("calibrated"))
    backend.calibrate(4, 2, 16, 16, torch.float16)
    assert backend.extend_limit is None
