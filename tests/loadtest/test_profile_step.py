"""`bench engine --profile` on a tiny model: the breakdown accounts for the whole step, and the
engine still produces the same tokens while instrumented."""

from __future__ import annotations

import json

import pytest

from loadtest.profile_step import profile


@pytest.fixture(autouse=True)
def _tiny_prompts(monkeypatch):
    # chat_prompts needs a chat template and a real vocabulary: a tiny model takes token ids.
    monkeypatch.setattr(
        "loadtest.workloads.chat_prompts", lambda tok, n: [[5 + i, 6, 7, 8] for i in range(n)]
    )


def test_profile_breakdown_adds_up(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "p.json"
    assert profile(str(tiny_model_dir), "float32", None, ("W1", "W2"), "off", out) == 0
    doc = json.loads(out.read_text())
    assert "outside kernels" in capsys.readouterr().out
    for name in ("W1", "W2"):
        r = doc["results"][name]
        parts = r["breakdown_ms"]
        inside = (
            parts["gemm"] + parts["attention"] + parts["other_ops"] + parts["python_in_forward"]
        )
        assert inside == pytest.approx(r["forward_ms"], abs=0.01)
        outside = sum(v for k, v in parts.items() if k.startswith("outside:"))
        assert inside + outside == pytest.approx(r["step_ms"], abs=0.02)
        assert parts["gemm"] > 0 and parts["attention"] > 0 and r["ops_per_step"] > 0
        expected = r["step_ms"] - parts["gemm"] - parts["attention"] - parts["outside:logits"]
        assert r["outside_kernels_ms"] == pytest.approx(expected, abs=0.02)
