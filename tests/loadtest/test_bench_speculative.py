"""loadtest/bench_speculative.py on a tiny model: its figures hang together (a benchmark is not
a test; this checks the arithmetic and that every plan it times runs)."""

from __future__ import annotations

import json

import pytest

from engine.kernels.cpu import decode_step, quant_gemm
from loadtest import bench_speculative


def test_the_breakdown_adds_up(tiny_model_dir, tmp_path, capsys):
    if decode_step.load() is None or quant_gemm.load() is None:
        pytest.skip("the C++ kernels did not build here (no compiler)")
    out = tmp_path / "spec.json"
    bench_speculative.main([
        "--model", str(tiny_model_dir), "--max-tokens", "40", "--rounds", "2",
        "--linear-kernel", "gemv", "--out", str(out),
    ])  # fmt: skip
    doc = json.loads(out.read_text())
    k = doc["draft_tokens"]
    assert set(doc["plan_ms"]) == {"draft", "1 row", *(f"{r} rows" for r in range(2, k + 2))}
    assert all(len(times) == 2 and min(times) > 0 for times in doc["plan_ms"].values())
    run = doc["run"]
    assert 0 < run["accepted"] <= run["drafted"]
    assert run["acceptance"] == round(run["accepted"] / run["drafted"], 3)
    assert 1 < run["tokens_per_verifying_step"] <= k + 1
    medians, per_token = doc["medians_ms"], doc["per_token_ms"]
    want = (k * medians["draft"] + medians[f"{k + 1} rows"]) / run["tokens_per_verifying_step"]
    assert per_token["speculative"] == pytest.approx(want, abs=2e-3)
    assert "kv_store" in doc["tasks_ms"][f"{k + 1} rows"] and "argmax" in doc["tasks_ms"]["draft"]
    assert "per token, ms" in capsys.readouterr().out


def test_the_lookups_breakdown_adds_up(tiny_model_dir, tmp_path, capsys):
    """With int4 weights: the plan at 1 to lookup_tokens + 1 rows, the greedy run's decode
    steps by rows, and the cost a token from them."""
    if decode_step.load() is None or quant_gemm.load() is None:
        pytest.skip("the C++ kernels did not build here (no compiler)")
    out = tmp_path / "lookup.json"
    bench_speculative.main([
        "--model", str(tiny_model_dir), "--quantization", "int4", "--max-tokens", "40",
        "--rounds", "2", "--num-prompts", "3", "--temperature", "0.8", "--wall-rounds", "1",
        "--out", str(out),
    ])  # fmt: skip
    doc = json.loads(out.read_text())
    k = doc["lookup_tokens"]
    assert list(doc["plan_ms"]) == ["1 row", *(f"{r} rows" for r in range(2, k + 2))]
    run = doc["run"]
    assert run["tokens"] == 3 * 40 and not doc["stop_at_eos"]
    by_rows = {int(r): n for r, n in run["decode_steps_by_rows"].items()}
    assert set(by_rows) <= set(range(1, k + 2))
    decode_tokens = run["tokens"] - 3
    assert sum(by_rows.values()) + run["kept"] == decode_tokens  # each step: 1 + what it kept
    medians = list(doc["medians_ms"].values())
    want = sum(n * medians[r - 1] for r, n in by_rows.items()) / decode_tokens
    assert doc["per_token_ms"]["speculative"] == pytest.approx(want, abs=2e-3)
    wall = doc["wall_clock"]  # sampled, on and off: the same tokens
    assert wall["same_tokens"] and len(wall["tok_s"]["on"]) == len(wall["tok_s"]["off"]) == 1
    assert "proposals kept" in capsys.readouterr().out


def test_together_compares_batch_verification_on_and_off(tiny_model_dir, tmp_path, capsys):
    """`--together 2`: groups of two requests, batch verification on and off in ABBA rounds;
    the constant it switches is put back; the counts hang together."""
    if decode_step.load() is None or quant_gemm.load() is None:
        pytest.skip("the C++ kernels did not build here (no compiler)")
    from engine import fused_decode

    before = fused_decode.BATCH_MAX_REQUESTS
    out = tmp_path / "together.json"
    bench_speculative.main([
        "--model", str(tiny_model_dir), "--quantization", "int4", "--max-tokens", "24",
        "--num-prompts", "4", "--together", "2", "--wall-rounds", "2", "--out", str(out),
    ])  # fmt: skip
    assert before == fused_decode.BATCH_MAX_REQUESTS
    doc = json.loads(out.read_text())
    assert len(doc["tok_s"]["on"]) == len(doc["tok_s"]["off"]) == 2
    assert doc["on_over_off"] == [
        round(a / b, 3) for a, b in zip(doc["tok_s"]["on"], doc["tok_s"]["off"], strict=True)
    ]
    assert 0 <= doc["batch_kept"] <= doc["batch_proposed"]
    assert doc["batch_steps"] > 0  # the tiny model's greedy answers repeat themselves
    assert 0 <= doc["answers_the_same"] <= 4
    assert "requests at a time" in capsys.readouterr().out
