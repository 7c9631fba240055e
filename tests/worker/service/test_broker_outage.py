"""A broker outage: the embedded broker stops under a running worker and comes back empty (its
storage is memory only). The worker must log the outage, wait it out without spinning the CPU,
recreate its topics, rejoin, serve again, and commit again, although the new log's offsets
restart below those it had already committed.

What this cannot see: the tracker's "the log went backwards: a new epoch" rule
(`OffsetTracker.add`). On the rejoin aiokafka revokes and reassigns the partition, and the
committed offset the empty broker reports (none) differs from this worker's, so the partition
starts a fresh epoch at the assignment already; with the rule disabled the test still passes.
The rule is covered by its unit test (test_offsets.py)."""

from __future__ import annotations

import asyncio
import time

import pytest
import structlog.testing
from aiokafka.admin import AIOKafkaAdminClient

from tests.worker.kafka_helpers import (
    Producer,
    ReplyReader,
    create_topic,
    fresh_topics,
    make_request,
    wait_for_commit,
    worker_settings,
)
from worker import broker as broker_module
from worker.service import worker as worker_module
from worker.service.worker import Worker

pytestmark = pytest.mark.kafka

OUTAGE_S = 6.0
MAX_CPU_SHARE = 0.25  # of one core


async def test_a_worker_serves_and_commits_again_after_the_broker_comes_back_empty(
    tiny_model_dir, monkeypatch
) -> None:
    """Guards against a worker that cannot come back from a broker that lost its data: topics
    not recreated, or commits that never resume because the new offsets (from 0 again) sit below
    the watermark it remembered from before."""
    monkeypatch.setattr(worker_module, "TOPIC_CHECK_INTERVAL_S", 1.0)
    own = broker_module.EmbeddedBroker()
    own.start()
    try:
        bootstrap = own.bootstrap_servers
        topic, group_id = fresh_topics()
        await create_topic(bootstrap, topic, 1)
        settings = worker_settings(tiny_model_dir, bootstrap, group_id, topic,
                                   kafka={"num_partitions": 1})  # fmt: skip
        worker = Worker(settings)
        await worker.start()
        try:
            await worker.wait_assigned()
            async with Producer(bootstrap) as producer, ReplyReader(bootstrap) as replies:
                for i in range(3):
                    request = make_request(replies.topic, f"before {i}", max_tokens=3)
                    await producer.send(topic, request)
                    await replies.final_of(request.id)
            await wait_for_commit(bootstrap, group_id, topic, 1, lambda c: c[0] == 3)

            with structlog.testing.capture_logs() as events:
                own.stop()  # the outage
                cpu_s, wall_s = time.process_time(), time.monotonic()
                await asyncio.sleep(OUTAGE_S)
                cpu_s, wall_s = time.process_time() - cpu_s, time.monotonic() - wall_s
            own.start()  # back on the same port, empty
            # Waiting out the outage is not work: the worker (its threads and its event loop;
            # this process does nothing else meanwhile) backs off instead of retrying in a
            # loop, which would burn a core. A bound on behaviour, far above backing off.
            print(f"\nCPU during the outage: {cpu_s:.2f} s in {wall_s:.1f} s")
            assert cpu_s < MAX_CPU_SHARE * wall_s, (cpu_s, wall_s)
            assert "worker.broker_unreachable" in {e["event"] for e in events}, events
            await wait_for_topic(bootstrap, topic)  # recreated by the worker, not by us

            async with Producer(bootstrap) as producer, ReplyReader(bootstrap) as replies:
                after = make_request(replies.topic, "after the outage", max_tokens=3)
                await producer.send(topic, after)
                final = await replies.final_of(after.id, timeout_s=60)
            assert final.finish_reason == "length"
            # The commit needs the group back first (coordinator found again, a new member id
            # from the empty broker, a rebalance): as long as the final's wait above, since a
            # fresh-clone `make test` on 2 busy cores once took more than 30 s.
            committed = await wait_for_commit(
                bootstrap, group_id, topic, 1, lambda c: c[0] == 1, timeout_s=60
            )
            assert committed[0] == 1  # offset 0 of the new log, below the old commit of 3
            assert not worker.failed.is_set()
        finally:
            await worker.stop(grace_s=2)
    finally:
        own.stop()


async def wait_for_topic(bootstrap_servers: str, topic: str, timeout_s: float = 60.0) -> None:
    deadline_s = time.monotonic() + timeout_s
    while True:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers, request_timeout_ms=30_000)
        try:
            await admin.start()
            if topic in await admin.list_topics():
                return
        except Exception:  # the broker is still starting
            pass
        finally:
            await admin.close()
        assert time.monotonic() < deadline_s, f"{topic} was not recreated"
        await asyncio.sleep(0.5)
