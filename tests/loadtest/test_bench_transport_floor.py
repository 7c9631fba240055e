"""The transport-floor bench: its streams are told per step, and every token's message is read."""

from __future__ import annotations

import argparse
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


def test_bench_e2e_runs_the_floor_with_its_own_workload_and_engine_settings(tmp_path, capsys):
    from loadtest import bench_e2e

    parser = argparse.ArgumentParser()
    bench_e2e.add_arguments(parser)
    args = parser.parse_args(
        ["--num-requests", "32", "--max-tokens", "64", "--quantization", "int8",
         "--kv-cache-dtype", "int8", "--num-threads", "2", "--floor"]
    )  # fmt: skip
    command = bench_e2e.floor_command(args, "/models/m", tmp_path / "f.json")
    flags = dict(zip(command[3::2], command[4::2], strict=True))
    assert command[1:3] == ["-m", "loadtest.bench_transport_floor"]
    assert flags == {
        "--sides": "none,thread", "--rounds": "1", "--num-streams": "32", "--num-tokens": "64",
        "--model": "/models/m", "--dtype": "auto", "--out": str(tmp_path / "f.json"),
        "--quantization": "int8", "--kv-cache-dtype": "int8", "--num-threads": "2",
    }  # fmt: skip
    # The floor bench knows every one of those flags: refused for the side given last, it
    # complains of that and of nothing else.
    with pytest.raises(SystemExit):
        floor.main([*command[3:], "--sides", "none,carrier-pigeon"])
    error = capsys.readouterr().err
    assert "unknown sides ['carrier-pigeon']" in error
    assert "unrecognized arguments" not in error


def test_bench_e2e_reads_the_floors_ratios():
    from loadtest import bench_e2e

    side = {"throughput_ratio": 0.9, "itl_ratio": 1.15, "messages_read": 128, "num_tokens": 128}
    doc = {"rounds": [{"none": {"throughput_ratio": 1.0, "itl_ratio": 1.0}, "thread": side}]}
    assert bench_e2e.floor_ratios(doc) == {
        "floor_throughput_ratio": 0.9, "floor_itl_ratio": 1.15, "floor_messages_read": 128,
        "floor_num_tokens": 128,
    }  # fmt: skip
