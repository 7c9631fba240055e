"""What one streamed token costs the worker's event loop: the reply path alone, on the real broker.

`mini-infer bench e2e` showed the worker's loop thread spending ~0.45 CPU seconds on W2's 4096
tokens (about 110 us a token) on the two cores the engine computes on. This bench isolates that
path: the worker's own `Pipeline.on_event` (the step's metrics, then its deltas: metrics, the
reply stream, encoding), `ReplyWriter`, `Publisher` and aiokafka's producer, against the
embedded broker, fed W2's shape of engine output (32 streaming requests, 128 tokens each, one
delta per request per step, a step every `--step-ms`, with the engine's cumulative stats) by
this process instead of an engine. It reports the process's CPU time (the loop
and aiokafka: nothing else runs here) per token, and the broker's, until every final is
acknowledged.

Each side runs in a fresh process, alternating for `--rounds`; `--baseline DIR` runs the same
bench against another checkout's worker code (its `worker/` and `schemas/` are imported), so a
change to the path is measured against the code before it in the same run.

    python -m loadtest.bench_reply_path [--rounds 5] [--baseline DIR] [--out r.json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from loadtest.bench_e2e import cpu_seconds
from loadtest.loadgen_service import create_bench_topics
from loadtest.report import emit
from loadtest.trees import alternate, print_result, sides_of


class _Bridge:
    """The pipeline's engine side, idle: the bench hands it deltas itself."""

    def __init__(self) -> None:
        self.events: asyncio.Queue = asyncio.Queue()

    def queued_tokens_at_least_as_urgent_as(self, priority: int) -> int:
        return 0

    def submit(self, requests) -> None:
        pass

    def abort(self, request_id: str) -> None:
        pass


async def _run(num_requests: int, num_tokens: int, step_s: float, broker_pid: int,
               bootstrap: str) -> dict:  # fmt: skip
    from aiokafka import TopicPartition

    from engine.outputs import EngineStats, RequestDelta
    from schemas.codec import MSGPACK, Limits, encode
    from schemas.headers import request_headers
    from schemas.messages import Request
    from worker.service.batcher import Batcher
    from worker.service.bridge import Deltas, StepInfo
    from worker.service.job import JobState
    from worker.service.offsets import OffsetTracker
    from worker.service.pipeline import Pipeline
    from worker.service.publisher import Publisher
    from worker.service.replies import ReplyWriter
    from worker.service.routing import Accepted, RoutingPolicy, route
    from worker.service.settings import WorkerSettings
    from worker.service.telemetry import Telemetry

    settings = WorkerSettings()
    reply_topic = settings.kafka.shared_reply_topic_name
    await create_bench_topics(bootstrap, {reply_topic: 4})
    publisher = Publisher(settings, bootstrap)
    await publisher.start()
    replies = ReplyWriter(
        publisher, settings.limits.max_message_bytes, settings.publisher.num_final_retries
    )
    tracker = OffsetTracker()
    partition = TopicPartition("requests", 0)
    tracker.assign([partition])
    dead = SimpleNamespace(write=lambda *a, **k: None)
    telemetry = Telemetry(settings.observability, "bench")
    pipeline = Pipeline(
        settings, "bench", _Bridge(), replies, dead, tracker,
        telemetry, SimpleNamespace(), Batcher(settings.batcher),
    )  # fmt: skip
    policy = RoutingPolicy(Limits(), settings.kafka.reply_topic_prefix, frozenset())
    jobs = []
    for i in range(num_requests):
        value = encode(
            Request(id=f"r{i}", reply_to=reply_topic, prompt="x", stream=True,
                    max_tokens=num_tokens, reply_partition=i % 4),
            MSGPACK,
        )  # fmt: skip
        decision = route(value, request_headers(MSGPACK), policy)
        assert isinstance(decision, Accepted), decision
        epoch = tracker.add(partition, i)
        record = SimpleNamespace(offset=i, key=None, value=value, headers=[], timestamp=None)
        job = pipeline._new_job(decision, partition, record, time.monotonic(), epoch)
        job.state = JobState.RUNNING
        jobs.append(job)
    words = [" the", " quick", " brown", " fox", " jumps", " over", " a", " lazy", " dog."]
    broker_before = cpu_seconds(broker_pid)
    cpu_before, wall_before = time.process_time(), time.perf_counter()
    for step in range(num_tokens):
        is_last = step == num_tokens - 1
        deltas = [
            RequestDelta(
                request_id=job.attempt, text=words[(step + i) % len(words)],
                token_ids=[1000 + step], finished=is_last,
                finish_reason="length" if is_last else None, num_prompt_tokens=32,
                num_output_tokens=step + 1,
            )
            for i, job in enumerate(jobs)
        ]  # fmt: skip
        # The step's stats, as the engine's fused decode step leaves them (cumulative).
        stats = EngineStats(
            num_blocks_total=1024, num_blocks_free=1024 - num_requests, num_blocks_cached=0,
            num_running=num_requests, num_waiting=0, num_preemptions=0, num_prefix_queries=0,
            num_prefix_hits=0, num_tokens_computed=(step + 1) * num_requests, num_tokens_reused=0,
            num_fused_steps=step + 1, fused_step_gil_wait_s=step * 1e-4,
        )  # fmt: skip
        pipeline.on_event(Deltas(deltas, StepInfo(time.monotonic(), step_s, stats)))
        await asyncio.sleep(step_s)  # the engine's step, during which the loop sends
    while any(job.state is not JobState.DONE for job in jobs):  # every final acknowledged
        await asyncio.sleep(0.005)
    # A collection records the measurements a worker keeps for it (its per-step and per-token
    # histograms'): that is counted too, as if scraped once at the end.
    telemetry.meter_provider.force_flush()
    cpu_s = time.process_time() - cpu_before
    wall_s = time.perf_counter() - wall_before
    broker_s = cpu_seconds(broker_pid) - broker_before
    await publisher.stop()
    num_messages = num_requests * num_tokens
    return {
        "messages": num_messages,
        "wall_s": round(wall_s, 3),
        "loop_cpu_s": round(cpu_s, 3),
        "loop_us_per_token": round(cpu_s / num_messages * 1e6, 1),
        "broker_us_per_token": round(broker_s / num_messages * 1e6, 1),
    }


def _child(args) -> None:
    from worker.broker import EmbeddedBroker

    with EmbeddedBroker() as broker:
        result = asyncio.run(
            _run(args.num_requests, args.num_tokens, args.step_ms / 1000, broker.pid,
                 broker.bootstrap_servers)
        )  # fmt: skip
    print_result(result)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--baseline", type=Path, help="another checkout to compare with")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--num-tokens", type=int, default=128)
    parser.add_argument("--step-ms", type=float, default=30.0, help="the simulated engine step")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args)
        return 0
    flags = ["--child", "--num-requests", str(args.num_requests),
             "--num-tokens", str(args.num_tokens), "--step-ms", str(args.step_ms)]  # fmt: skip
    env = {"MINI_INFER_OBSERVABILITY__LOG_LEVEL": "warning"}
    runs = alternate(__file__, sides_of(args.baseline), flags, args.rounds, 600, env)
    medians = {
        name: {k: statistics.median(r[k] for r in rs) for k in ("loop_us_per_token",
                                                                "broker_us_per_token")}
        for name, rs in runs.items()
    }  # fmt: skip
    print(f"\n{'side':10} {'loop us/token':>14} {'broker us/token':>16}   (medians of {args.rounds})")
    for name, m in medians.items():
        print(f"{name:10} {m['loop_us_per_token']:14.1f} {m['broker_us_per_token']:16.1f}")
    doc = {
        "workload": f"{args.num_requests} streams x {args.num_tokens} tokens, a step every "
                    f"{args.step_ms} ms",  # fmt: skip
        "load_average": os.getloadavg()[0],
        "medians": medians,
        "rounds": runs,
    }
    if "baseline" in medians:
        doc["loop_ratio_this_over_baseline"] = round(
            medians["this"]["loop_us_per_token"] / medians["baseline"]["loop_us_per_token"], 3
        )
        print(f"loop CPU per token, this / baseline: {doc['loop_ratio_this_over_baseline']}")
    emit(doc, args.out, None, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
