"""One short real run of the load generator: the embedded broker, a worker with a tiny random
model, a two-rate sweep of four requests each (one of them cancelled halfway), JSON and plots."""

from __future__ import annotations

import argparse

import pytest

from loadtest.loadgen import add_arguments, build_workload, run_command
from tests.worker.kafka_helpers import create_topic, fresh_topics, worker_settings
from tests.worker.workers import running_worker

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(180)]

OUTPUT_LEN = 4


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_workload_is_seeded_and_shaped() -> None:
    args = parse(["--num-prompts", "8", "--input-len", "10", "--range-ratio", "0.5",
                  "--urgency-mix", "critical:0.5,low:0.5", "--cancel-fraction", "0.25"])  # fmt: skip
    specs = build_workload(args)
    assert specs == build_workload(args)
    assert all(5 <= len(s.prompt.split()) == s.target_prompt_len <= 15 for s in specs)
    assert {s.urgency for s in specs} <= {"critical", "low"}
    assert sum(s.cancel_after_tokens is not None for s in specs) == 2
    assert build_workload(parse(["--seed", "1"])) != build_workload(parse(["--seed", "2"]))


async def test_short_real_run(broker, tiny_model_dir, tmp_path) -> None:
    topic, group_id = fresh_topics()
    await create_topic(broker.bootstrap_servers, topic, 2)
    settings = worker_settings(tiny_model_dir, broker.bootstrap_servers, group_id, topic)
    async with running_worker(settings):
        args = parse([
            "--bootstrap-servers", broker.bootstrap_servers, "--request-topic", topic,
            "--control-topic", topic + ".control", "--num-prompts", "4", "--sweep", "20,inf",
            "--input-len", "6", "--output-len", str(OUTPUT_LEN),
            "--urgency-mix", "critical:0.5,low:0.5", "--cancel-fraction", "0.25",
            "--goodput", "ttft:60000", "e2el:60000", "--timeout-s", "60",
            "--plot-dir", str(tmp_path), "--no-progress",
        ])  # fmt: skip
        doc = await run_command(args, broker.bootstrap_servers)
        # A deadline of 0 ms after sending has passed when the worker reads the request (and
        # the chat dataset's messages go through the worker's chat template).
        expired = await run_command(
            parse([
                "--request-topic", topic, "--control-topic", topic + ".control",
                "--num-prompts", "2", "--deadline-ms", "0", "--dataset", "chat", "--no-progress",
            ]),
            broker.bootstrap_servers,
        )  # fmt: skip

    runs = doc["sweep"]
    assert [r["request_rate"] for r in runs] == [20.0, "inf"]
    for run in runs:
        assert run["finish_reasons"] == {"length": 3, "cancelled": 1}, run["errors"]
        assert (run["completed"], run["cancelled"], run["failed"]) == (3, 1, 0)
        # ignore_eos: every served request made exactly its output length, by the worker's count.
        assert run["total_output_tokens"] == 3 * OUTPUT_LEN
        assert run["total_input_tokens"] > 0
        assert run["request_goodput"] == pytest.approx(run["request_throughput"])  # loose SLOs
        for key in ("mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "mean_itl_ms", "p99_itl_ms",
                    "mean_e2el_ms", "output_throughput", "request_throughput"):  # fmt: skip
            assert run[key] > 0, key
        assert sum(m["completed"] + m["cancelled"] for m in run["per_urgency"].values()) == 4
        assert set(run["per_urgency"]) <= {"critical", "low"}
        split = run["latency_split"]
        assert split["num_requests"] == 3
        assert split["decode"]["mean_decode_ms"] > 0 and split["kafka"]["mean_kafka_ms"] > 0
        # One ITL sample per gap between reply messages: at most one per token (a random model's
        # tokens can be partial characters, which the worker holds back and sends together).
        assert len(run["ttfts"]) == 4
        assert all(len(itls) <= OUTPUT_LEN - 1 for itls in run["itls"])
    assert expired["finish_reasons"] == {"expired": 2}
    assert (expired["completed"], expired["failed"], expired["request_throughput"]) == (0, 2, 0)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latency_cdf_rate_20.png", "latency_cdf_rate_inf.png", "sweep.png",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "argv",
    [
        ["--num-prompts", "0"],
        ["--urgency-mix", "critical:0.5"],
        ["--request-rate", "0"],
        ["--burstiness", "-1"],
        ["--goodput", "itl:5"],
        ["--cancel-fraction", "1.5"],
        ["--range-ratio", "1"],
        ["--percentiles", "50,101"],
    ],
)
def test_bad_input_fails_before_anything_starts(argv: list[str], capsys) -> None:
    from loadtest.loadgen import main

    assert main(parse(argv)) == 2  # no broker or worker was started: it returns at once
    assert "mini-infer loadtest:" in capsys.readouterr().err


async def test_backlog_scenario_run(broker, tiny_model_dir, tmp_path) -> None:
    """`--backlog`: the backlog goes first (low, on the base topic), the measured critical
    requests after it by their lane; with --backlog-wait every backlog TTFT is exact."""
    topic, group_id = fresh_topics()
    await create_topic(broker.bootstrap_servers, topic, 1)
    settings = worker_settings(tiny_model_dir, broker.bootstrap_servers, group_id, topic)
    async with running_worker(settings):
        args = parse([
            "--bootstrap-servers", broker.bootstrap_servers, "--request-topic", topic,
            "--control-topic", topic + ".control", "--num-prompts", "2", "--backlog", "6",
            "--backlog-lead-s", "0.2", "--backlog-wait", "--urgency-mix", "critical:1",
            "--input-len", "6", "--output-len", str(OUTPUT_LEN), "--timeout-s", "60",
            "--plot-dir", str(tmp_path), "--no-progress",
        ])  # fmt: skip
        doc = await run_command(args, broker.bootstrap_servers)
    assert doc["completed"] == 2 and set(doc["per_urgency"]) == {"critical"}
    backlog = doc["backlog"]
    assert (backlog["num_backlog"], backlog["num_backlog_first_token"]) == (6, 6)
    assert not backlog["backlog_ttft_is_lower_bound"] and backlog["backlog_median_ttft_ms"] > 0
    assert len(backlog["backlog_sent_s"]) == 6 and len(backlog["measured_sent_s"]) == 2
    assert max(backlog["backlog_sent_s"]) <= min(backlog["measured_sent_s"])
    assert (tmp_path / "backlog_ttft.png").stat().st_size > 0


def test_a_censored_backlog_reports_a_lower_bound() -> None:
    from loadtest.loadgen_backlog import CENSORED, BacklogRun, summarize_backlog
    from loadtest.loadgen_stats import RequestResult

    answered = RequestResult(urgency="low", chunk_times_s=[1.0])
    unanswered = [RequestResult(urgency="low", error=CENSORED) for _ in range(2)]
    run = BacklogRun(
        measured=[], backlog=[answered, *unanswered], measured_sent_s=[],
        backlog_sent_s=[0.0, 0.0, 1.0], censored_ttft_s=[1.0, 5.0, 4.0], stop_s=5.0,
        duration_s=5.0,
    )  # fmt: skip
    summary = summarize_backlog(run, measured_p50_ttft_ms=400.0)
    assert summary["backlog_ttft_is_lower_bound"] and summary["num_backlog_first_token"] == 1
    assert summary["backlog_median_ttft_ms"] == 4000.0
    assert summary["measured_over_backlog_ttft_p50"] == pytest.approx(0.1)
