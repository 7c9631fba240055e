"""loadtest/bench_inprocess_ab.py: each side's engine is built with its constants set, which
are restored after; its figures hang together (a benchmark is not a test)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.kernels.cpu import decode_step
from loadtest import bench_inprocess_ab


def test_each_engine_is_built_with_its_sides_constants(tiny_model_dir, tmp_path, monkeypatch):
    seen = []
    real = bench_inprocess_ab.build_with

    def spy(assignments, build):
        return real(assignments, lambda: (seen.append(decode_step.LEAST_TAKE_BYTES), build())[1])

    monkeypatch.setattr(bench_inprocess_ab, "build_with", spy)
    before = decode_step.LEAST_TAKE_BYTES
    out = tmp_path / "ab.json"
    name = "engine.kernels.cpu.decode_step.LEAST_TAKE_BYTES"
    bench_inprocess_ab.main([
        "--model", str(tiny_model_dir), "--options", "{}", "--rounds", "3",
        "--max-tokens", "6", "--set-a", f"{name}=4096", "--set-b", f"{name}=1099511627776",
        "--load-order", "b,a", "--out", str(out),
    ])  # fmt: skip
    assert seen == [1 << 40, 4096]  # B built first, each with its own value
    assert before == decode_step.LEAST_TAKE_BYTES
    doc = json.loads(out.read_text())
    assert all(len(doc["tokens_per_s"][side]) == 3 for side in "ab")
    speeds = doc["tokens_per_s"]
    pairs = sorted(a / b for a, b in zip(speeds["a"], speeds["b"], strict=True))
    assert doc["a_over_b_pairwise_median"] == pytest.approx(pairs[1], abs=1e-3)


@given(st.text(max_size=40))
def test_an_assignment_is_a_dotted_name_and_a_literal_or_refused(text):
    try:
        module, name, value = bench_inprocess_ab.parse_assignment(text)
    except ValueError:
        return
    assert module and name.isidentifier() and f"{module}.{name}" in text


def test_a_constant_the_module_lacks_is_refused_and_nothing_stays_set():
    before = decode_step.LEAST_TAKE_BYTES
    with pytest.raises(ValueError, match="has no"):
        bench_inprocess_ab.build_with([
            "engine.kernels.cpu.decode_step.LEAST_TAKE_BYTES=1",
            "engine.kernels.cpu.decode_step.NO_SUCH_CONSTANT=2",
        ], lambda: None)  # fmt: skip
    assert before == decode_step.LEAST_TAKE_BYTES


def test_task_clocks_give_each_round_and_side_the_steps_tasks(tiny_model_dir, tmp_path):
    out = tmp_path / "ab.json"
    name = "engine.fused_decode.SILU_SPLIT_ROWS"
    bench_inprocess_ab.main([
        "--model", str(tiny_model_dir), "--options", '{"quantization": "int4"}', "--rounds", "2",
        "--max-tokens", "5", "--set-a", f"{name}=8", "--set-b", f"{name}=0", "--task-clocks",
        "--out", str(out),
    ])  # fmt: skip
    doc = json.loads(out.read_text())
    for side in "ab":
        rounds = doc["task_ms_per_step"][side]
        assert len(rounds) == 2
        for spans in rounds:
            assert {"norm", "silu_mul", "gate_up_proj"} <= set(spans)
            assert all(v >= 0 for v in spans.values()) and spans["gate_up_proj"] > 0
        medians = doc["task_ms_medians"]["norm"][side]
        assert min(s["norm"] for s in rounds) <= medians <= max(s["norm"] for s in rounds)
