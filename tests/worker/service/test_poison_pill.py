"""No single message can stop the pool: whatever one request does to the worker's per-message
path, that request gets an error final (or a dead letter), its neighbours are answered, the
worker stays up and the partition's commit passes every one of them.

The real worker and embedded broker. The first test is the reproduction from the field (a JSON
`deadline_ms` of a few hundred digits killed the batcher task, and the worker with it, and every
worker that took the partition over); the second injects a bug at each stage of the per-message
path (admission, release to the engine, handling a delta) for one marked request each.
"""

from __future__ import annotations

import json

import pytest

from schemas.codec import JSON
from schemas.headers import request_headers
from schemas.messages import ErrorCode
from tests.worker.kafka_helpers import (
    create_topic,
    dlq_records,
    fresh_topics,
    make_request,
    serving,
    wait_for_commit,
    worker_settings,
)
from worker.service import pipeline as pipeline_module
from worker.service.prompts import PromptRenderer
from worker.service.reply_stream import ReplyStream
from worker.service.worker import Worker

pytestmark = pytest.mark.kafka

HUGE = int("9" * 300)


async def test_a_huge_integer_in_a_json_request_is_answered_and_the_worker_stays_up(
    broker, tiny_model_dir
) -> None:
    """Guards against a number no consumer can hold (deadline_ms, seed, top_k, ... with
    hundreds of digits) passing decoding and raising deeper in, killing the worker."""
    topic, group_id = fresh_topics()
    await create_topic(broker.bootstrap_servers, topic, 1)
    settings = worker_settings(tiny_model_dir, broker.bootstrap_servers, group_id, topic)
    worker = Worker(settings)
    fields = ["deadline_ms", "seed", "top_k", "max_tokens", "schema_version", "stop_token_ids"]
    async with serving(broker, worker, grace_s=5) as (producer, replies):
        before = make_request(replies.topic, id="before", max_tokens=3)
        await producer.send(topic, before)
        for field in fields:
            value = [HUGE] if field == "stop_token_ids" else HUGE
            body = {"id": f"huge-{field}", "reply_to": replies.topic, "prompt": "hi"}
            raw = json.dumps({**body, field: value}).encode()
            await producer.send_raw(
                topic, raw, body["id"].encode(), request_headers(JSON, "critical")
            )
        after = make_request(replies.topic, id="after", max_tokens=3)
        await producer.send(topic, after)
        for field in fields:
            final = await replies.final_of(f"huge-{field}")
            assert final.finish_reason == "error", field
            assert final.error.code == ErrorCode.INVALID_REQUEST and field in final.error.message
        for request in (before, after):
            assert (await replies.final_of(request.id)).finish_reason == "length"
        num_records = len(fields) + 2
        committed = await wait_for_commit(
            broker.bootstrap_servers, group_id, topic, 1, lambda c: c[0] == num_records
        )
        assert committed[0] == num_records
        assert not worker.failed.is_set()


async def test_a_bug_at_any_stage_fails_only_its_own_request(
    broker, tiny_model_dir, monkeypatch
) -> None:
    """Guards against an exception while handling one request (rendering its prompt, releasing
    its batch to the engine, handling its engine delta) killing a worker task, losing its batch
    neighbours or leaving its offset unfinished forever."""
    render = PromptRenderer.render

    def render_or_raise(self, request):
        if request.prompt == "poison at admission":
            raise OverflowError("int too large to convert to float")
        return render(self, request)

    engine_request = pipeline_module.EngineRequest

    def engine_request_or_raise(*args, **kwargs):
        if args[2].max_tokens == 13:  # the marked request of the batch
            raise OverflowError("cannot release this one")
        return engine_request(*args, **kwargs)

    add = ReplyStream.add

    def add_or_raise(self, text, token_ids, *rest):
        if self.request_id == "poison-delta":
            raise UnicodeError("bad delta")
        return add(self, text, token_ids, *rest)

    finish = ReplyStream.finish

    def finish_or_raise(self, *args, **kwargs):
        if self.request_id == "poison-final":  # while its final is made: the job is FINISHING
            raise ValueError("bad final")
        return finish(self, *args, **kwargs)

    monkeypatch.setattr(ReplyStream, "finish", finish_or_raise)
    monkeypatch.setattr(PromptRenderer, "render", render_or_raise)
    monkeypatch.setattr(pipeline_module, "EngineRequest", engine_request_or_raise)
    monkeypatch.setattr(ReplyStream, "add", add_or_raise)

    topic, group_id = fresh_topics()
    await create_topic(broker.bootstrap_servers, topic, 1)
    settings = worker_settings(tiny_model_dir, broker.bootstrap_servers, group_id, topic)
    worker = Worker(settings)
    async with serving(broker, worker, grace_s=5) as (producer, replies):
        poisons = [
            make_request(replies.topic, "poison at admission", id="poison-admission"),
            make_request(replies.topic, "poison at release", id="poison-release", max_tokens=13),
            make_request(replies.topic, "poison in a delta", id="poison-delta"),
        ]
        neighbours = [make_request(replies.topic, f"neighbour {i}", id=f"n{i}") for i in range(4)]
        # No final can be made for this one: it is dead-lettered (fail() on a FINISHING job
        # used to do nothing, and its offset held the partition's commits for good).
        no_final = make_request(replies.topic, "poison in its final", id="poison-final")
        # `low`: a 50 ms window, so the poisons and their neighbours share release batches.
        order = [neighbours[0], *poisons[:2], neighbours[1], poisons[2], no_final, *neighbours[2:]]
        for request in order:
            await producer.send(topic, request, urgency="low")
        for request in poisons:
            final = await replies.final_of(request.id)
            assert final.finish_reason == "error" and final.error.code == ErrorCode.INTERNAL
        for request in neighbours:
            assert (await replies.final_of(request.id)).finish_reason == "length"
        (dead,) = await dlq_records(broker.bootstrap_servers, settings.kafka.dlq_topic, 1)
        assert dead.key == b"poison-final" and not replies.finals(no_final.id)
        num_records = len(order)
        committed = await wait_for_commit(
            broker.bootstrap_servers, group_id, topic, 1, lambda c: c[0] == num_records
        )
        assert committed[0] == num_records
        assert not worker.failed.is_set()
        assert all(not task.done() for task in worker._tasks)
