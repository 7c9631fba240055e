"""The transport-floor bench: its streams are told per step, and every token's message is read."""

from __future__ import annotations

from collections import Counter

import pytest

from engine import LLMEngine
from loadtest import bench_transport_floor as floor


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(tiny_model_dir, block_size=4, num_kv_blocks=64)


def test_generate_tells_each_step_which_streams_got_a_token(engine):
    steps: list[list[int]] = []
    result = floor._generate(engine, ["one two", "three", "four five six"], 5, steps.append)
    assert Counter(i for step in steps for i in step) == {0: 5, 1: 5, 2: 5}
    assert all(len(step) == len(set(step)) for step in steps)  # a token per stream per step
    assert result["num_tokens"] == 15
    assert result["itl_ms"] > 0 and result["tokens_per_s"] > 0


@pytest.mark.kafka
@pytest.mark.timeout(120)
@pytest.mark.parametrize("side", ["process", "thread"])
def test_a_side_sends_every_token_and_reads_it_back(engine, side):
    result = floor._run_side(side, engine, ["one two", "three"], 6)
    assert result["num_tokens"] == 12
    assert result["messages_read"] == 12
    assert set(result["cpu_us_per_token"]) == {"broker", "consumer", "producer"}


def test_an_unknown_side_is_refused():
    with pytest.raises(SystemExit):
        floor.main(["--sides", "none,carrier-pigeon"])
