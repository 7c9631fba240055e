"""A survivor that keeps some partitions and gains others answers every request of the gained
ones: none is dropped while its rebalance listener awaits.

aiokafka marks the new assignment done before it awaits `on_partitions_assigned`, so `getmany`
returns records of newly assigned partitions while the listener still awaits the committed
offsets of the partitions it kept. Apache Kafka answers those fetches at once; the test broker
holds them, which hid the race. Here the survivor talks to the broker through the
fault-injecting proxy (fetches answered at once), and its listener's await is held until
`getmany` has returned the gained partitions' records, so they arrive during it every time.
Before the fix those records were dropped without a word and the next commit passed over them
(this test timed out waiting for their finals).
"""

from __future__ import annotations

import contextlib

import pytest
from aiokafka import TopicPartition

from tests.worker.kafka_helpers import (
    Producer,
    ReplyReader,
    create_topic,
    fresh_topics,
    make_request,
    wait_for,
    worker_settings,
)
from tests.worker.kafka_proxy import KafkaProxy
from tests.worker.workers import wait_for_split
from worker.service.worker import Worker

pytestmark = pytest.mark.kafka

# The request topic's partitions only: lane topics would join the split the test waits for.
NO_LANES = {"urgency_lanes": False}

NUM_PARTITIONS = 4
NUM_PER_PARTITION = 3


def hold_listener_until_fetched(worker: Worker, gained: set[TopicPartition]) -> None:
    """The listener's await (`committed` of a kept partition) returns only once `getmany`
    has returned the gained partitions' records (their positions moved past them): the window
    of the race made a fact, not a matter of timing. Bounded, so that a fix that pauses the
    gained partitions during the listener is not held forever."""
    consumer = worker.consumer._consumer
    committed = consumer.committed

    async def slow_committed(partition):
        assignment = consumer._subscription.subscription.assignment
        with contextlib.suppress(TimeoutError):
            await wait_for(
                lambda: all(_position(assignment, p) >= NUM_PER_PARTITION for p in gained),
                10, "the gained partitions to be fetched",
            )  # fmt: skip
        return await committed(partition)

    consumer.committed = slow_committed


def _position(assignment, partition: TopicPartition) -> int:
    if partition not in assignment.tps:
        return -1
    state = assignment.state_value(partition)
    return state.position if state.has_valid_position else -1


async def test_records_of_gained_partitions_are_answered_while_the_listener_awaits(
    broker, tiny_model_dir
) -> None:
    topic, group_id = fresh_topics()
    await create_topic(broker.bootstrap_servers, topic, NUM_PARTITIONS)
    async with (
        KafkaProxy(broker.bootstrap_servers) as proxy,
        Producer(broker.bootstrap_servers) as producer,
        ReplyReader(broker.bootstrap_servers) as replies,
    ):
        survivor = Worker(
            worker_settings(
                tiny_model_dir, proxy.bootstrap_servers, group_id, topic, kafka=NO_LANES
            )
        )
        leaver = Worker(
            worker_settings(
                tiny_model_dir, broker.bootstrap_servers, group_id, topic, kafka=NO_LANES
            )
        )
        await survivor.start()
        try:
            await leaver.start()
            await wait_for_split([survivor, leaver], NUM_PARTITIONS)
            gained = {p for p in leaver.consumer.assignment}
            hold_listener_until_fetched(survivor, gained)
            await leaver.stop(grace_s=0)
            ids = []
            for partition in sorted(
                p.partition for p in gained
            ):  # waiting for the survivor, which does not own them yet
                for i in range(NUM_PER_PARTITION):
                    request = make_request(replies.topic, id=f"p{partition}-{i}", max_tokens=2)
                    await producer.send(topic, request, partition=partition)
                    ids.append(request.id)
            await wait_for_split([survivor], NUM_PARTITIONS)  # the rebalance
            await replies.wait_until(
                lambda: all(replies.finals(i) for i in ids), 30, "a final for every request"
            )
        finally:
            await survivor.stop(grace_s=0)
