"""`bench_wake_cost` measures each sleep length on both kinds of thread and reports per wake-up."""

from __future__ import annotations

import json

from loadtest import bench_wake_cost


def test_it_reports_cpu_and_latency_per_wake_up_for_each_sleep(tmp_path, capsys) -> None:
    out = tmp_path / "wake.json"
    assert bench_wake_cost.main(["--sleeps-ms", "0.1,2", "--n", "5", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [row["sleep_ms"] for row in doc["rows"]] == [0.1, 2.0]
    for row in doc["rows"]:
        for side in ("thread", "asyncio"):
            assert row[side]["cpu_us_per_wake"] >= 0
            # a sleep never ends early, so the latency beyond it is not negative (1 us slack for
            # the clocks' rounding)
            assert row[side]["latency_us_per_wake"] > -1
    assert "thread CPU us" in capsys.readouterr().out
