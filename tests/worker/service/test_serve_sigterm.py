"""`mini-infer serve` as a real process: SIGTERM mid-generation exits 0 within the grace period,
and the work it could not finish is redelivered to the next worker and answered."""

from __future__ import annotations

import asyncio
import signal
import time

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
from tests.worker.workers import SERVE_GRACE_S as GRACE_S
from tests.worker.workers import log_events, running_worker, serve_process

pytestmark = pytest.mark.kafka

LONG_MAX_TOKENS = 64


async def test_sigterm_drains_exits_zero_and_unfinished_work_is_redelivered(
    broker, tiny_model_dir, tmp_path
) -> None:
    topic, group_id = fresh_topics()
    await create_topic(broker.bootstrap_servers, topic, 2)
    # The engine is gated (gated_serve.py): it steps once all three requests are in, until the
    # short one finishes, then never again; so the long ones are running at SIGTERM and can
    # never finish within the grace period: a fact, not a race against a fast machine.
    async with (
        serve_process(
            broker.bootstrap_servers, tiny_model_dir, group_id, topic, tmp_path,
            extra_env={"MINI_INFER_TEST_GATE": "3"}, module="tests.worker.service.gated_serve",
        ) as process,
        Producer(broker.bootstrap_servers) as producer,
        ReplyReader(broker.bootstrap_servers) as replies,
    ):  # fmt: skip
        ready_file, log_path = process.ready_file, process.log_path
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
        assert (await replies.final_of(short.id, timeout_s=60)).attempt.startswith("terminated:")
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
        # `serve` owns its process: start-up's heap was frozen once it was ready.
        frozen = [e for e in log_events(log_path) if e.get("event") == "worker.heap_frozen"]
        assert len(frozen) == 1 and frozen[0]["num_objects"] > 10_000, frozen
        assert not ready_file.exists()

        settings = worker_settings(tiny_model_dir, broker.bootstrap_servers, group_id, topic, worker_id="next",
                                   kafka={"control_topic": topic + ".control", "dlq_topic": topic + ".dlq"})  # fmt: skip
        async with running_worker(settings, is_assigned=False):
            for request in unfinished:
                final = await replies.final_of(request.id, timeout_s=90)
                assert final.attempt.startswith("next:")
                assert final.usage.completion_tokens == LONG_MAX_TOKENS
            # The short request was committed by the terminated worker: not answered again.
            assert len(replies.finals(short.id)) == 1
