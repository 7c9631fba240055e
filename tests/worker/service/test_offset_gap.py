"""A request batch that one fetch did not show is still read, answered and committed.

The embedded broker can answer a fetch that races a write from another connection with a later
batch while an earlier one is still being stored; aiokafka's position then moves past the
earlier batch, and the watermark commits over requests never read. Here the fault-injecting
proxy makes that fact: the worker's first fetch loses the second (or the first) of five
request batches. Without the refetch (worker/offset_gaps.py) that request was never answered
and its offset was committed over.
"""

from __future__ import annotations

import pytest

from tests.worker.kafka_helpers import (
    Producer,
    ReplyReader,
    create_topic,
    fresh_topics,
    make_request,
    wait_for_commit,
    worker_settings,
)
from tests.worker.kafka_proxy import KafkaProxy
from tests.worker.workers import running_worker

pytestmark = pytest.mark.kafka

NUM_REQUESTS = 5


@pytest.mark.parametrize("hidden", [1, 0], ids=["second batch", "first batch"])
async def test_a_request_batch_hidden_from_a_fetch_is_answered_and_committed(
    broker, tiny_model_dir, hidden
) -> None:
    """The second batch: a gap after a record read. The first: a gap before the epoch's first
    record, seen against the partition's position at the assignment."""
    topic, group_id = fresh_topics()
    await create_topic(broker.bootstrap_servers, topic, 1)
    async with (
        KafkaProxy(broker.bootstrap_servers) as proxy,
        Producer(broker.bootstrap_servers) as producer,
        ReplyReader(broker.bootstrap_servers) as replies,
    ):
        ids = []
        for i in range(NUM_REQUESTS):  # each its own batch, all there before the first fetch
            request = make_request(replies.topic, f"request {i}", max_tokens=2)
            await producer.send(topic, request, partition=0)
            ids.append(request.id)
        proxy.hide_batch(topic, hidden)
        settings = worker_settings(
            tiny_model_dir, proxy.bootstrap_servers, group_id, topic,
            kafka={"urgency_lanes": False},
        )  # fmt: skip
        async with running_worker(settings) as worker:
            await replies.wait_until(
                lambda: all(replies.finals(i) for i in ids), 60, "a final for every request"
            )
            committed = await wait_for_commit(
                broker.bootstrap_servers, group_id, topic, 1, lambda c: c[0] == NUM_REQUESTS
            )
            assert proxy.num_hidden_batches == 1  # the fault happened
            assert worker.consumer._gaps.num_refetches == 1
        assert committed == {0: NUM_REQUESTS}
        assert [replies.finals(i)[0].finish_reason for i in ids] == ["length"] * NUM_REQUESTS
