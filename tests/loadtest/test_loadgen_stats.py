"""The load generator's arithmetic against hand-computed cases (and numpy for percentiles)."""

from __future__ import annotations

import math
import random
import statistics

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadtest.loadgen_stats import (
    RequestResult,
    arrival_gaps_s,
    arrival_offsets_s,
    assign_urgencies,
    compute_metrics,
    is_good,
    latency_split_ms,
    parse_goodput,
    parse_urgency_mix,
    percentile,
    percentile_key,
    sample_lengths,
    summarize_run,
    ttft_split_ms,
)


def served(urgency="normal", chunks=(0.1, 0.15, 0.25, 0.3), e2el=0.35, out=4, prompt=10, **kw):
    return RequestResult(
        urgency=urgency,
        prompt_len=prompt,
        output_len=out,
        e2el_s=e2el,
        chunk_times_s=list(chunks),
        finish_reason=kw.pop("finish_reason", "length"),
        **kw,
    )


# --- percentiles ------------------------------------------------------------------------------


def test_percentile_hand_computed() -> None:
    xs = [4.0, 1.0, 3.0, 2.0]  # order must not matter
    assert percentile(xs, 50) == 2.5
    assert percentile(xs, 90) == pytest.approx(3.7)  # rank 2.7: 3 + 0.7 * (4 - 3)
    assert percentile(xs, 99) == pytest.approx(3.97)
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile([5.0], 99) == 5.0
    assert percentile([], 99) == 0.0  # vLLM: np.percentile(xs or 0, q)
    with pytest.raises(ValueError, match="percentile"):
        percentile(xs, 101)


@settings(deadline=None)
@given(
    st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=50),
    st.floats(0, 100),
)
def test_percentile_matches_numpy(xs: list[float], q: float) -> None:
    assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-9, abs=1e-6)


def test_percentile_keys_as_vllm() -> None:
    assert percentile_key(99) == "p99" and percentile_key(99.9) == "p99.9"


# --- one request: TTFT, ITL, TPOT -------------------------------------------------------------


def test_ttft_itl_tpot_definitions() -> None:
    r = served()  # chunks at 0.10, 0.15, 0.25, 0.30 s; final at 0.35 s; 4 tokens
    assert r.ttft_s == 0.1
    assert r.itls_s == pytest.approx([0.05, 0.10, 0.05])
    assert r.tpot_s == pytest.approx((0.35 - 0.1) / 3)
    assert served(out=1, chunks=(0.2,), e2el=0.2).tpot_s is None  # undefined for one token
    assert not served(finish_reason="expired").is_served
    assert not RequestResult(urgency="low", finish_reason="stop").is_served  # no latency


def test_metrics_hand_computed() -> None:
    results = [
        served(chunks=(0.1, 0.2, 0.4), e2el=0.5, out=3, prompt=10),  # tpot (0.5-0.1)/2 = 0.2
        served(chunks=(0.3, 0.4), e2el=0.5, out=2, prompt=20),  # tpot 0.2
        served(chunks=(0.2,), e2el=0.2, out=1, prompt=30),  # no tpot
        served(finish_reason="expired", prompt=99, out=9),
        served(finish_reason="cancelled", prompt=99, out=9),
    ]
    m = compute_metrics(results, duration_s=2.0, percentiles=[50, 99])
    assert (m["completed"], m["failed"], m["cancelled"]) == (3, 1, 1)
    assert m["finish_reasons"] == {"length": 3, "expired": 1, "cancelled": 1}
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (60, 6)
    assert m["request_throughput"] == 1.5 and m["output_throughput"] == 3.0
    assert m["total_token_throughput"] == 33.0
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["p99_ttft_ms"] == pytest.approx(298.0)  # ranks 0.1, 0.2, 0.3: 0.2 + 0.98 * 0.1
    assert m["mean_tpot_ms"] == pytest.approx(200.0) and m["std_tpot_ms"] == pytest.approx(0.0)
    # ITL samples: 0.1, 0.2 (first request) and 0.1 (second)
    assert m["mean_itl_ms"] == pytest.approx(400 / 3)
    assert m["median_itl_ms"] == pytest.approx(100.0)
    assert m["mean_e2el_ms"] == pytest.approx(400.0)
    assert m["std_e2el_ms"] == pytest.approx(statistics.pstdev([500, 500, 200]))
    assert m["request_goodput"] is None  # no SLOs given


def test_goodput_arithmetic() -> None:
    slos = parse_goodput(["ttft:150", "tpot:100"])
    good = served(chunks=(0.1, 0.15, 0.25, 0.3), e2el=0.35, out=4)  # ttft 100, tpot 83.3
    late_first = served(chunks=(0.2, 0.25), e2el=0.3, out=2)  # ttft 200 > 150
    slow_tokens = served(chunks=(0.1, 0.3), e2el=0.4, out=2)  # tpot 300 > 100
    one_token = served(chunks=(0.15,), e2el=0.15, out=1)  # ttft 150 == SLO holds, tpot 0
    expired = served(finish_reason="expired")
    assert [is_good(r, slos) for r in (good, late_first, slow_tokens, one_token, expired)] == [
        True, False, False, True, False,
    ]  # fmt: skip
    m = compute_metrics([good, late_first, slow_tokens, one_token, expired], 4.0, slos)
    assert m["request_goodput"] == 0.5  # 2 good requests in 4 s
    assert is_good(slow_tokens, {"e2el": 400})
    assert not is_good(slow_tokens, {"e2el": 399})


def test_per_urgency_and_latency_split() -> None:
    timing = {"queued_ms": 10.0, "ttft_ms": 60.0, "total_ms": 260.0}
    results = [
        served("critical", e2el=0.3, worker_timing=timing),  # kafka 300 - 260 = 40 ms
        served("low", e2el=0.5, worker_timing={**timing, "queued_ms": 30.0}),  # kafka 240 ms
        served("low", finish_reason="error", worker_timing=timing),  # not served: left out
    ]
    doc = summarize_run(results, 1.0, percentiles=[50])
    assert doc["completed"] == 2
    assert set(doc["per_urgency"]) == {"critical", "low"}
    assert doc["per_urgency"]["low"]["completed"] == 1
    assert doc["per_urgency"]["low"]["failed"] == 1
    split = doc["latency_split"]
    assert split["num_requests"] == 2
    assert split["kafka"]["mean_kafka_ms"] == pytest.approx(140.0)
    assert split["batcher"]["mean_batcher_ms"] == pytest.approx(20.0)
    assert split["engine_queue_prefill"]["mean_engine_queue_prefill_ms"] == pytest.approx(40.0)
    assert split["decode"]["median_decode_ms"] == pytest.approx(200.0)
    assert latency_split_ms([])["num_requests"] == 0


def test_ttft_split_puts_the_workers_ttft_beside_the_clients() -> None:
    """Client TTFT 100 ms = request's way in (kafka_ms 15) + the worker's ttft_ms (60) + the
    first token's way out (25); a final without kafka_ms counts in worker_ttft only; a request
    with no token or no final is left out."""
    timing = {"queued_ms": 5.0, "ttft_ms": 60.0, "total_ms": 200.0, "kafka_ms": 15.0}
    results = [
        served("critical", chunks=(0.1, 0.2), worker_timing=timing),
        served("low", chunks=(2.0, 2.1), worker_timing={**timing, "ttft_ms": 1900.0}),
        served("low", chunks=(0.5,), worker_timing={k: v for k, v in timing.items() if k != "kafka_ms"}),
        served("low", chunks=(), worker_timing=timing, finish_reason="expired"),  # no token
        served("low", chunks=(0.3,), worker_timing=None),  # no final
    ]  # fmt: skip
    split = ttft_split_ms(results, percentiles=[50])
    assert split["num_requests"] == 3
    assert split["median_worker_ttft_ms"] == pytest.approx(60.0)  # of 60, 1900, 60
    assert split["median_kafka_in_ms"] == pytest.approx(15.0)
    assert split["mean_reply_out_ms"] == pytest.approx((25.0 + 85.0) / 2)  # 2000 - 15 - 1900
    doc = summarize_run(results, 1.0, percentiles=[50])
    assert doc["per_urgency"]["critical"]["ttft_split"]["median_reply_out_ms"] == pytest.approx(25)
    assert doc["ttft_split"]["num_requests"] == 3
    assert ttft_split_ms([])["num_requests"] == 0


# --- arrivals and workload shape --------------------------------------------------------------


def test_arrival_gaps_mean_and_seed_determinism() -> None:
    gaps = arrival_gaps_s(20_000, request_rate=4.0, burstiness=1.0, seed=7)
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.03)
    # Poisson arrivals: exponential gaps, whose standard deviation equals their mean.
    assert statistics.pstdev(gaps) == pytest.approx(0.25, rel=0.05)
    assert gaps == arrival_gaps_s(20_000, 4.0, 1.0, seed=7)
    assert gaps[:10] != arrival_gaps_s(10, 4.0, 1.0, seed=8)


def test_burstiness_keeps_the_mean_and_sets_the_spread() -> None:
    for burstiness in (0.25, 4.0):
        gaps = arrival_gaps_s(20_000, 2.0, burstiness, seed=1)
        assert statistics.fmean(gaps) == pytest.approx(0.5, rel=0.05)
        cv = statistics.pstdev(gaps) / statistics.fmean(gaps)
        assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.08)


def test_arrival_edge_cases() -> None:
    assert arrival_gaps_s(3, math.inf, 1.0, seed=0) == [0.0, 0.0, 0.0]
    assert arrival_offsets_s([0.5, 0.25, 1.0]) == [0.0, 0.5, 0.75]
    for rate, burstiness in ((0.0, 1.0), (-1.0, 1.0), (1.0, 0.0), (1.0, math.inf)):
        with pytest.raises(ValueError):
            arrival_gaps_s(3, rate, burstiness, seed=0)


def test_lengths_fixed_and_ranged() -> None:
    rng = random.Random(0)
    assert sample_lengths(5, 32, 0.0, rng) == [32] * 5
    xs = sample_lengths(2000, 100, 0.5, rng)
    assert min(xs) == 50 and max(xs) == 150
    assert set(sample_lengths(100, 1, 0.9, rng)) == {1, 2}  # floor(0.1) -> at least 1; ceil(1.9)
    with pytest.raises(ValueError):
        sample_lengths(1, 0, 0.0, rng)
    with pytest.raises(ValueError):
        sample_lengths(1, 10, 1.0, rng)


def test_urgency_mix() -> None:
    mix = parse_urgency_mix("critical:0.1,normal:0.6,low:0.3")
    assert mix == {"critical": 0.1, "normal": 0.6, "low": 0.3}
    drawn = assign_urgencies(10_000, mix, random.Random(3))
    assert drawn.count("critical") / 10_000 == pytest.approx(0.1, abs=0.015)
    assert drawn.count("low") / 10_000 == pytest.approx(0.3, abs=0.02)
    assert "high" not in drawn
    bad_mixes = (
        "critical:0.5",
        "urgent:1",
        "normal",
        "normal:x",
        "low:.5,low:.5",
        "low:-1,normal:2",
    )
    for bad in bad_mixes:
        with pytest.raises(ValueError):
            parse_urgency_mix(bad)


def test_goodput_parse_errors() -> None:
    assert parse_goodput(["e2el:1000"]) == {"e2el": 1000.0}
    for bad in (["itl:5"], ["ttft"], ["ttft:x"], ["ttft:0"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)
