"""loadtest/bench_fetch_hold.py's produce cost: its figures hang together against a real broker
(a benchmark is not a test: no timing is asserted)."""

from __future__ import annotations

import asyncio

import pytest

from loadtest import bench_fetch_hold

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(120)]


def test_produce_cost_counts_each_awaited_request_and_the_brokers_cpu(broker):
    result = asyncio.run(
        bench_fetch_hold.produce_cost(broker.bootstrap_servers, 30, 100, broker.pid)
    )
    assert result["requests"] == 30
    assert result["ms_per_request"] > 0 and result["producer_us_per_request"] > 0
    assert result["broker_us_per_request"] >= 0
    # without the broker's pid, no broker figure rather than a made-up one
    no_pid = asyncio.run(bench_fetch_hold.produce_cost(broker.bootstrap_servers, 3, 10, None))
    assert "broker_us_per_request" not in no_pid
