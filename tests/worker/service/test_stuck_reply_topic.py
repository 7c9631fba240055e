"""A reply topic that refuses every write (as Apache Kafka refuses a topic whose in-sync replicas
are short: NOT_ENOUGH_REPLICAS, which an idempotent producer retries forever) must not stall the
worker: its requests are dead-lettered (`final_undeliverable`) within the delivery deadline and
their partition's commit moves past them, other clients keep getting their answers, and SIGTERM
still ends the process, exit 0, within the stop budget.

`mini-infer serve` as a real process, talking to the broker through the fault-injecting proxy;
the clients talk to the broker directly. Before the fix the refused final's future never
completed (the partition's commits stopped for good) and the shutdown flushed, then waited in
aiokafka's own flush, without bound.
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from schemas.contract import DeadLetterReason
from schemas.headers import ERROR_REASON, get_text_header
from tests.conftest import unique_name
from tests.worker.kafka_helpers import (
    PREFIX,
    Producer,
    ReplyReader,
    create_topic,
    dlq_records,
    fresh_topics,
    make_request,
    wait_for_commit,
)
from tests.worker.kafka_proxy import KafkaProxy
from tests.worker.workers import serve_process

pytestmark = pytest.mark.kafka

DELIVERY_TIMEOUT_S = 2.0
STOP_BUDGET_S = 8.0


async def test_a_refused_reply_topic_is_dead_lettered_and_sigterm_exits_within_the_budget(
    broker, tiny_model_dir, tmp_path
) -> None:
    topic, group_id = fresh_topics()
    await create_topic(broker.bootstrap_servers, topic, 1)
    refused_topic = PREFIX + unique_name("refused")
    await create_topic(broker.bootstrap_servers, refused_topic, 1)
    async with (
        KafkaProxy(broker.bootstrap_servers) as proxy,
        Producer(broker.bootstrap_servers) as producer,
        ReplyReader(broker.bootstrap_servers) as replies,
    ):
        proxy.fail_produce(refused_topic)
        async with serve_process(
            proxy.bootstrap_servers, tiny_model_dir, group_id, topic, tmp_path,
            num_partitions=1,
            extra_env={
                "MINI_INFER_PUBLISHER__DELIVERY_TIMEOUT_S": str(DELIVERY_TIMEOUT_S),
                "MINI_INFER_STOP_BUDGET_S": str(STOP_BUDGET_S),
            },
        ) as process:  # fmt: skip
            first = make_request(refused_topic, id="refused-1", max_tokens=4)
            await producer.send(topic, first)
            others = [make_request(replies.topic, id=f"ok-{i}", max_tokens=4) for i in range(3)]
            for request in others:
                await producer.send(topic, request)
            for request in others:  # not held behind the refused topic
                assert (await replies.final_of(request.id, 60)).finish_reason == "length"
            (dead,) = await dlq_records(broker.bootstrap_servers, topic + ".dlq", 1, 30)
            assert dead.key == b"refused-1"
            reason = get_text_header(dead.headers, ERROR_REASON)
            assert reason == DeadLetterReason.FINAL_UNDELIVERABLE
            committed = await wait_for_commit(
                broker.bootstrap_servers, group_id, topic, 1, lambda c: c[0] == 4
            )
            assert committed[0] == 4  # past the refused request
            # One more to the refused topic, in flight at SIGTERM: the stop must not wait on it.
            await producer.send(topic, make_request(refused_topic, id="refused-2", max_tokens=4))
            last = make_request(replies.topic, id="ok-last", max_tokens=4)
            await producer.send(topic, last)
            await replies.final_of(last.id, 60)
            process.send_signal(signal.SIGTERM)
            started_s = time.monotonic()
            while process.poll() is None and time.monotonic() - started_s < STOP_BUDGET_S + 10:
                await asyncio.sleep(0.1)
            assert process.poll() == 0, process.log_path.read_text()[-3000:]
