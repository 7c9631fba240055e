"""loadtest/trees.py's `alternate`: the sides' order flips every round, results stay per side
in round order."""

from __future__ import annotations

from pathlib import Path

from loadtest import trees


def test_alternate_flips_the_order_every_round(monkeypatch):
    calls = []

    def fake_run(script, tree, flags, timeout_s, env):
        calls.append(tree.name)
        return {"tree": tree.name, "call": len(calls)}

    monkeypatch.setattr(trees, "run_in_tree", fake_run)
    runs = trees.alternate("s.py", {"baseline": Path("/a/base"), "this": Path("/a/this")}, [], 4,
                           timeout_s=1)  # fmt: skip
    assert calls == ["base", "this", "this", "base", "base", "this", "this", "base"]
    assert [r["call"] for r in runs["baseline"]] == [1, 4, 5, 8]
    assert [r["call"] for r in runs["this"]] == [2, 3, 6, 7]
