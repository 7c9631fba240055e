"""The consumer's fetch wait: the short one while the worker has nothing in flight (an idle
worker reads a new request within it on the embedded broker, which holds an empty fetch for the
whole wait), the long one while it works (fewer empty fetches beside the engine; Apache Kafka
answers a fetch as soon as data arrive, so it costs no latency there). Real broker; the engine
is held at a gate, so "in flight" is a fact, not a race."""

from __future__ import annotations

import contextlib
import threading

import pytest

from tests.worker.kafka_helpers import (
    SMALL_ENGINE,
    Producer,
    ReplyReader,
    SlowEngine,
    create_topic,
    fresh_topics,
    make_request,
    wait_for,
    worker_settings,
)
from tests.worker.workers import running_worker
from worker.service.consumer import fetch_wait_ms, poll_timeout_ms

pytestmark = pytest.mark.kafka


def test_fetch_wait_is_the_long_one_only_with_work_in_flight() -> None:
    from worker.service.settings import KafkaSettings

    kafka = KafkaSettings(fetch_max_wait_ms=20, fetch_max_wait_busy_ms=250)
    assert fetch_wait_ms(kafka, num_unfinished=0) == 20
    assert fetch_wait_ms(kafka, num_unfinished=1) == 250
    # never shorter than the idle wait, whatever is configured
    assert fetch_wait_ms(KafkaSettings(fetch_max_wait_ms=300, fetch_max_wait_busy_ms=100), 5) == 300


def test_the_poll_waits_as_long_as_the_fetch_unless_a_partition_is_paused() -> None:
    """The loop wakes once per fetch, not every idle wait as well; with a partition paused
    (bounds reached, or held through a rebalance) it keeps the short wait, so a freed slot
    resumes reading as soon as before."""
    from worker.service.settings import KafkaSettings

    kafka = KafkaSettings(fetch_max_wait_ms=20, fetch_max_wait_busy_ms=250)
    assert poll_timeout_ms(kafka, fetch_wait_ms(kafka, 0), is_any_paused=False) == 20
    assert poll_timeout_ms(kafka, fetch_wait_ms(kafka, 3), is_any_paused=False) == 250
    assert poll_timeout_ms(kafka, fetch_wait_ms(kafka, 3), is_any_paused=True) == 20


def test_a_fetcher_without_the_attribute_keeps_its_wait() -> None:
    """Where aiokafka's fetcher has no `_fetch_max_wait_ms` (another aiokafka), the consumer
    stops trying (and logs it once); with it, the attribute is set."""
    from types import SimpleNamespace

    from worker.service.consumer import RequestConsumer

    consumer = object.__new__(RequestConsumer)  # only the state _set_fetch_wait reads
    consumer._consumer, consumer.fetch_wait_ms = SimpleNamespace(_fetcher=object()), 20
    consumer._set_fetch_wait(100)
    assert consumer.fetch_wait_ms is None
    consumer._set_fetch_wait(20)
    assert consumer.fetch_wait_ms is None
    fetcher = SimpleNamespace(_fetch_max_wait_ms=20)
    consumer._consumer, consumer.fetch_wait_ms = SimpleNamespace(_fetcher=fetcher), 20
    consumer._set_fetch_wait(100)
    assert fetcher._fetch_max_wait_ms == consumer.fetch_wait_ms == 100


@contextlib.asynccontextmanager
async def _worker_held_at_a_gate(broker, tiny_model_dir, busy_ms: int):
    """A worker (one request partition; fetch waits 20 ms idle, `busy_ms` busy) whose engine
    waits at the gate; yields (producer, replies, worker, topic, gate)."""
    from engine import LLMEngine

    topic, group_id = fresh_topics()
    await create_topic(broker.bootstrap_servers, topic, 1)
    settings = worker_settings(
        tiny_model_dir, broker.bootstrap_servers, group_id, topic,
        kafka={"num_partitions": 1, "fetch_max_wait_ms": 20, "fetch_max_wait_busy_ms": busy_ms},
    )  # fmt: skip
    gate = threading.Event()
    factory = lambda: SlowEngine(LLMEngine(str(tiny_model_dir), **SMALL_ENGINE), 0.0, gate)  # noqa: E731
    async with (
        Producer(broker.bootstrap_servers) as producer,
        ReplyReader(broker.bootstrap_servers) as replies,
        running_worker(settings, factory, grace_s=10) as worker,
    ):
        yield producer, replies, worker, topic, gate


async def test_the_fetcher_waits_longer_while_a_request_is_in_flight(
    broker, tiny_model_dir
) -> None:
    async with _worker_held_at_a_gate(broker, tiny_model_dir, 300) as held:
        producer, replies, worker, topic, gate = held
        consumer = worker.consumer
        await wait_for(lambda: consumer.fetch_wait_ms == 20, what="the idle fetch wait")
        request = make_request(replies.topic, "held", max_tokens=3)
        await producer.send(topic, request)
        await wait_for(lambda: consumer.fetch_wait_ms == 300, what="the busy fetch wait")
        assert consumer.fetcher_wait_ms() == 300  # what aiokafka's next fetch request carries
        assert consumer.poll_timeout_ms == 300  # the loop wakes with the fetch, not between
        gate.set()
        await replies.wait_until(lambda: replies.finals(request.id), what="the final")
        await wait_for(lambda: consumer.fetch_wait_ms == 20, what="the idle wait again")
        assert consumer.fetcher_wait_ms() == 20
        await wait_for(lambda: consumer.poll_timeout_ms == 20, what="the idle poll again")


async def test_the_idle_wait_applies_as_soon_as_the_last_request_is_done(
    broker, tiny_model_dir
) -> None:
    """The next fetch waits the idle time once nothing is in flight, without waiting for the
    poll (which, busy, waits as long as the busy fetch: 8 s here, with no records coming). A
    request sent just after the last one finished would otherwise wait in a fetch that still
    carried the busy wait."""
    async with _worker_held_at_a_gate(broker, tiny_model_dir, 8000) as held:
        producer, replies, worker, topic, gate = held
        consumer = worker.consumer
        request = make_request(replies.topic, "held", max_tokens=3)
        await producer.send(topic, request)
        await wait_for(lambda: consumer.poll_timeout_ms == 8000, what="the busy poll")
        gate.set()
        await replies.wait_until(lambda: replies.finals(request.id), what="the final")
        await wait_for(lambda: worker.tracker.num_unfinished == 0, what="the offset done")
        assert consumer.fetcher_wait_ms() == 20  # set when the offset was done...
        assert consumer.poll_timeout_ms == 8000  # ...while the busy poll still waits
