"""The soak's verdict arithmetic (the run itself takes minutes: `python -m loadtest.soak`; a
worker process alone needs tens of seconds to start here, too long for `make test`).

Guards against a verdict that cannot fail: a growing RSS, a growing fd count, blocks in use when
idle, or a p99 that doubled must each turn it to not ok."""

from __future__ import annotations

import pytest

from loadtest.soak import Outcome, Sample, slope_per_min, verdict, window_latencies

DURATION_S = 600.0


def samples(rss=lambda t: 500.0, fds=lambda t: 20) -> list[Sample]:
    return [Sample(t, rss(t), fds(t), 0.0, 3) for t in range(0, int(DURATION_S) + 1, 5)]


def windows(p99_last: float) -> list[dict]:
    p99s = [900.0, 100.0] + [100.0] * 7 + [p99_last]  # the first is the warm-up
    return [{"start_s": 60.0 * i, "ttft_p99_ms": p} for i, p in enumerate(p99s)]


def test_slope_is_per_minute() -> None:
    assert slope_per_min([(0.0, 10.0), (60.0, 12.0), (120.0, 14.0)]) == pytest.approx(2.0)
    assert slope_per_min([(5.0, 1.0)]) == 0.0


def test_a_steady_run_passes() -> None:
    result = verdict(samples(), windows(150.0), 0.0, DURATION_S)
    assert result["ok"], result
    assert result["ttft_p99_first_window_ms"] == 100.0  # the warm-up window is left out


@pytest.mark.parametrize(
    ("rss", "fds", "leaked", "p99_last", "failed"),
    [
        (lambda t: 500.0 + t / 6, lambda t: 20, 0.0, 100.0, "rss_flat"),  # 10 MiB/min
        (lambda t: 500.0, lambda t: 20 + int(t // 60), 0.0, 100.0, "fds_flat"),
        (lambda t: 500.0, lambda t: 20, 4.0, 100.0, "no_leaked_blocks"),
        (lambda t: 500.0, lambda t: 20, 0.0, 250.0, "p99_stable"),
    ],
)
def test_each_kind_of_drift_fails_the_verdict(rss, fds, leaked, p99_last, failed) -> None:
    result = verdict(samples(rss, fds), windows(p99_last), leaked, DURATION_S)
    assert not result[failed] and not result["ok"]


def test_windows_count_only_served_requests() -> None:
    outcomes = [
        Outcome(0.0, "low", "plain", "length", 0.1, 1.0, 5.0),
        Outcome(0.0, "low", "cancel", "cancelled", None, 0.5, 6.0),
        Outcome(0.0, "high", "plain", "stop", 0.3, 2.0, 65.0),
    ]
    first, second = window_latencies(outcomes, 60.0, 120.0)
    assert first["num_served"] == 1 and first["ttft_p50_ms"] == 100.0
    assert second["num_served"] == 1 and second["e2e_p99_ms"] == 2000.0
