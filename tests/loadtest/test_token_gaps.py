"""report.token_gaps: the gaps between a stream's tokens, pooled over streams, as a reader got
them; what a mean inter-token latency cannot show (bursts)."""

from hypothesis import given
from hypothesis import strategies as st

from loadtest.report import BUNCHED_GAP_S, token_gaps


def test_a_steady_stream_and_a_bursty_one_share_a_mean_but_not_their_gaps():
    steady = [[i * 0.004 for i in range(9)]]  # a token every 4 ms
    bursty = [[(i // 4) * 0.016 + (i % 4) * 1e-5 for i in range(9)]]  # 4 at once, every 16 ms
    # (the bursty stream's last token comes alone, so its span is 2 bursts: 32 ms, as steady's)
    s, b = token_gaps(steady), token_gaps(bursty)
    assert s["mean_ms"] == b["mean_ms"] == 4.0
    assert s["bunched_share"] == 0 and s["p50_ms"] == 4.0 and s["p99_ms"] == 4.0
    assert b["bunched_share"] == 0.75  # 6 of 8 gaps within a burst
    assert b["p50_ms"] < BUNCHED_GAP_S * 1000 < b["p90_ms"]
    assert b["max_ms"] > 15


def test_streams_pool_their_gaps_and_one_token_streams_add_none():
    gaps = token_gaps([[0.0, 0.001], [5.0, 5.003, 5.006], [7.0]])
    assert gaps["num_gaps"] == 3
    assert gaps["max_ms"] == 3.0 and gaps["cdf_ms"][0] == 1.0 and gaps["cdf_ms"][-1] == 3.0
    assert token_gaps([[1.0], []]) == {}


@given(st.lists(st.lists(st.floats(0, 1), min_size=0, max_size=20), min_size=1, max_size=5))
def test_percentiles_are_gaps_that_occurred_in_order(streams):
    arrivals = [sorted(s) for s in streams]
    gaps = sorted(b - a for s in arrivals for a, b in zip(s, s[1:], strict=False))
    summary = token_gaps(arrivals)
    if not gaps:
        assert summary == {}
        return
    values = {round(g * 1000, 3) for g in gaps}
    cdf = summary["cdf_ms"]
    assert len(cdf) == 101 and cdf == sorted(cdf) and set(cdf) <= values
    assert summary["p50_ms"] == cdf[50] and summary["p99_ms"] == cdf[99]
    assert summary["max_ms"] == cdf[100] == round(gaps[-1] * 1000, 3)
    share = sum(g < BUNCHED_GAP_S for g in gaps) / len(gaps)
    assert summary["bunched_share"] == round(share, 3)
