"""`mini-infer serve` as a real process: SIGTERM mid-generation exits 0 within the grace period,
and the work it could not finish is redelivered to the next worker and answered."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import unique_name
from tests.worker.kafka_helpers import (
    Producer,
    ReplyReader,
    create_topic,
    fresh_topics,
    make_request,
    worker_settings,
)
from worker.service.worker import Worker

pytestmark = pytest.mark.kafka

REPO_ROOT = Path(__file__).resolve().parents[3]
GRACE_S = 0.5
LONG_MAX_TOKENS = 64


def start_serve(
    bootstrap_servers: str,
    model_dir: Path,
    group_id: str,
    topic: str,
    ready_file: Path,
    log_path: Path,
    worker_id: str = "terminated",
    num_partitions: int = 2,
    extra_env: dict[str, str] | None = None,
    module: str = "worker.cli",
) -> subprocess.Popen:
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO_ROOT),
        "MINI_INFER_ENGINE__KV_CACHE_MEMORY_BYTES": str(32 << 20),
        "MINI_INFER_KAFKA__CONTROL_TOPIC": topic + ".control",
        "MINI_INFER_KAFKA__DLQ_TOPIC": topic + ".dlq",
        # As in the other tests: the embedded broker makes a successor wait for the leaver's
        # session to expire, so a shorter (still Kafka-legal) session keeps the test short.
        "MINI_INFER_KAFKA__SESSION_TIMEOUT_MS": "6000",
        "MINI_INFER_KAFKA__HEARTBEAT_INTERVAL_MS": "1000",
        **(extra_env or {}),
    }
    command = [
        sys.executable, "-m", module, "serve",
        "--bootstrap-servers", bootstrap_servers, "--model", str(model_dir), "--group-id", group_id,
        "--request-topic", topic, "--partitions", str(num_partitions), "--grace-s", str(GRACE_S),
        "--ready-file", str(ready_file), "--worker-id", worker_id, "--log-format", "json",
    ]  # fmt: skip
    with open(log_path, "wb") as log_file:
        return subprocess.Popen(
            command, cwd=REPO_ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT
        )


async def wait_for_file(
    path: Path, process: subprocess.Popen, log_path: Path, timeout_s: float = 90.0
) -> None:
    deadline_s = time.monotonic() + timeout_s
    while not path.exists():
        if process.poll() is not None or time.monotonic() > deadline_s:
            process.kill()
            raise AssertionError(f"serve did not get ready:\n{log_path.read_text()[-3000:]}")
        await asyncio.sleep(0.1)


def log_events(log_path: Path) -> list[dict]:
    events = []
    for line in log_path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # the embedded-broker banner or a library's plain print
    return events


async def test_sigterm_drains_exits_zero_and_unfinished_work_is_redelivered(
    broker, tiny_model_dir, tmp_path
) -> None:
    topic, group_id = fresh_topics()
    await create_topic(broker.bootstrap_servers, topic, 2)
    ready_file, log_path = tmp_path / "ready.json", tmp_path / "serve.log"
    # The engine is gated (gated_serve.py): it steps once all three requests are in, until the
    # short one finishes, then never again; so the long ones are running at SIGTERM and can
    # never finish within the grace period: a fact, not a race against a fast machine.
    process = start_serve(
        broker.bootstrap_servers, tiny_model_dir, group_id, topic, ready_file, log_path,
        extra_env={"MINI_INFER_TEST_GATE": "3"}, module="tests.worker.service.gated_serve",
    )  # fmt: skip
    try:
        await wait_for_file(ready_file, process, log_path)
        async with (
            Producer(broker.bootstrap_servers) as producer,
            ReplyReader(broker.bootstrap_servers) as replies,
        ):
            short = make_request(replies.topic, "short one", max_tokens=4)
            await producer.send(topic, short)
            long = [
                make_request(
                    replies.topic,
                    f"long {i}",
                    id=unique_name("long"),
                    max_tokens=LONG_MAX_TOKENS,
                    ignore_eos=True,
                )
                for i in range(2)
            ]
            for request in long:
                await producer.send(topic, request)
            assert (await replies.final_of(short.id, timeout_s=60)).attempt.startswith(
                "terminated:"
            )
            # The short one's final came from the gated engine: the long ones are in it, with
            # tokens made (their text may still be buffered: a token can decode to nothing).
            signalled_s = time.monotonic()
            process.send_signal(signal.SIGTERM)
            return_code = await asyncio.to_thread(process.wait, GRACE_S + 20)
            assert return_code == 0, log_path.read_text()[-3000:]
            assert time.monotonic() - signalled_s < GRACE_S + 20
            # What the grace period could not finish was aborted without a final.
            unfinished = [r for r in long if not replies.finals(r.id)]
            assert unfinished == long  # the gate made that a fact
            drained = [e for e in log_events(log_path) if e.get("event") == "worker.drained"]
            assert drained and drained[0]["num_redelivered"] == len(unfinished)
            assert not ready_file.exists()

            settings = worker_settings(tiny_model_dir, broker.bootstrap_servers, group_id, topic, worker_id="next",
                                       kafka={"control_topic": topic + ".control", "dlq_topic": topic + ".dlq"})  # fmt: skip
            successor = Worker(settings)
            await successor.start()
            try:
                for request in unfinished:
                    final = await replies.final_of(request.id, timeout_s=90)
                    assert final.attempt.startswith("next:")
                    assert final.usage.completion_tokens == LONG_MAX_TOKENS
                # The short request was committed by the terminated worker: not answered again.
                assert len(replies.finals(short.id)) == 1
            finally:
                await successor.stop(grace_s=5)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
