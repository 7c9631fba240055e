"""Urgent work gets through a saturated worker: a `critical` request sent while the engine runs
at `max_num_seqs` and its queue holds a full token budget of `low` prompts is read, released
and run (preempting low work) before any of the low requests ahead of it finishes."""

from __future__ import annotations

import pytest

from tests.worker.kafka_helpers import (
    SMALL_ENGINE,
    SlowEngine,
    create_topic,
    fresh_topics,
    make_request,
    serving,
    wait_for,
    worker_settings,
)
from worker.service.worker import Worker

pytestmark = pytest.mark.kafka


async def test_a_critical_request_overtakes_a_saturated_worker(broker, tiny_model_dir) -> None:
    """Guards against urgency stopping at a full worker: the batcher held everything while the
    engine had a full budget of queued (low) prompt tokens, so a critical request waited for
    low work to finish."""
    topic, group_id = fresh_topics()
    await create_topic(broker.bootstrap_servers, topic, 1)
    settings = worker_settings(
        tiny_model_dir, broker.bootstrap_servers, group_id, topic,
        engine={"max_num_seqs": 2}, batcher={"max_batch_tokens": 64},
    )  # fmt: skip
    worker = Worker(settings, engine_factory=two_seq_slow_engine(tiny_model_dir))
    async with serving(broker, worker, grace_s=0) as (producer, replies):
        lows = [
            make_request(replies.topic, f"{i} " + "low " * 40, max_tokens=60,
                         ignore_eos=True)
            for i in range(16)
        ]  # fmt: skip
        for request in lows:
            await producer.send(topic, request, urgency="low")
        # Two lows generating (the engine is at max_num_seqs), the rest queued or held.
        await wait_for(
            lambda: sum(1 for j in worker.pipeline.active_jobs() if j.first_token_s) >= 2
        )
        # ... and the engine's queue holds a low prompt (the batcher hands one over as soon as
        # its budget allows: wait for that state rather than assume it at this instant).
        await wait_for(lambda: worker.bridge.queued_tokens > 0)
        # As long as a low prompt: it cannot squeeze into what the low ones left of the budget.
        critical = make_request(replies.topic, "urgent " * 40, max_tokens=3, ignore_eos=True)
        await producer.send(topic, critical, urgency="critical")
        final = await replies.final_of(critical.id)
        assert final.finish_reason == "length"
        assert not any(replies.finals(r.id) for r in lows)


def two_seq_slow_engine(model_dir):
    def build():
        from engine import LLMEngine

        return SlowEngine(LLMEngine(str(model_dir), **{**SMALL_ENGINE, "max_num_seqs": 2}), 0.03)

    return build
