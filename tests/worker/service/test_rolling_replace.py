"""A 12-partition backlog drained by three workers, each replaced in turn by the stop SIGTERM
runs (a rolling update): every request is answered, at least once; duplicates are counted.

The engines are fakes (no model: one token per step), so the test is about the worker's
offsets and rebalances, not generation. Each first-generation worker answers a few requests
and then stalls (its steps return nothing); the replacements answer nothing until the last old
one is gone. So every partition keeps unanswered requests throughout, and each old worker is
stopped holding work in flight, unanswered, on partitions that move: a fact, not a race
against the machine. Workers run in this process (a join takes a second, not an
interpreter and a model load); `Worker.stop` is the ordered stop `serve` runs on SIGTERM.

Each replacement holds partitions before its old worker is stopped (a surge: what a Deployment
of three replicas does by default, maxSurge 1 and maxUnavailable 0). Stopping the old one while
the new one's join is still pending is as legal on Apache Kafka, but the embedded broker then
loses the group when the leaving worker is the group's leader: every later JoinGroup answer
names the departed member as leader, no live member assigns, each SyncGroup times out and the
group stays "rebalancing" for good. Plain aiokafka consumers, without any worker code, do the
same (docs/KAFKA.md); Kafka elects a new leader.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from engine.outputs import RequestDelta
from schemas.codec import MSGPACK, encode
from schemas.headers import request_headers
from tests.worker.kafka_helpers import (
    Producer,
    ReplyReader,
    create_topic,
    fresh_topics,
    make_request,
    wait_for,
    wait_for_commit,
    worker_settings,
)
from tests.worker.workers import is_split
from worker.service.worker import Worker

pytestmark = pytest.mark.kafka

NUM_PARTITIONS = 12
NUM_WORKERS = 3
NUM_REQUESTS = 120  # 10 a partition
NUM_ANSWERS_BEFORE_STALL = 6
MAX_TOKENS = 2
GRACE_S = 0.5  # the stalled work cannot finish: it is dropped, to be redelivered


class FakeEngine:
    """LLMEngine's API without a model: `max_tokens` tokens, one per step, text "t". With
    `num_answers`, it finishes that many requests and then stalls for good; with `gate`, it
    stalls until the gate is set."""

    max_model_len = 2048

    def __init__(
        self, model_dir: Path, num_answers: int | None = None, gate: threading.Event | None = None
    ) -> None:
        self.model_path = str(model_dir)  # the worker loads its tokenizer from here
        self.num_answers = num_answers
        self.gate = gate
        self.num_finished = 0
        self.requests: dict[str, list[int]] = {}  # id -> [max tokens, tokens made, prompt]

    @property
    def is_stalled(self) -> bool:
        if self.gate is not None and not self.gate.is_set():
            return True
        return self.num_answers is not None and self.num_finished >= self.num_answers

    def add_request(self, request_id, prompt, params, priority=0) -> None:
        self.requests[request_id] = [params.max_tokens, 0, len(prompt)]

    def abort_request(self, request_id) -> bool:
        return self.requests.pop(request_id, None) is not None

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestDelta]:
        if self.is_stalled:
            time.sleep(0.005)  # an empty step: the engine thread still reads its inbox
            return []
        deltas = []
        # Newest first: what a stalling engine answered sits behind what it never will, on
        # the same partitions, so it is redelivered too (the duplicates at-least-once allows).
        for request_id, state in reversed(list(self.requests.items())):
            if self.is_stalled:
                break
            state[1] += 1
            is_done = state[1] >= state[0]
            deltas.append(RequestDelta(
                request_id, "t", [7], is_done, "length" if is_done else None, state[2], state[1]
            ))  # fmt: skip
            if is_done:
                del self.requests[request_id]
                self.num_finished += 1
        return deltas


class Member:
    """One worker of the group with its (fake) engine."""

    def __init__(self, name: str, model_dir, bootstrap_servers, group_id, topic, engine_options):
        settings = worker_settings(
            model_dir, bootstrap_servers, group_id, topic, worker_id=name,
            kafka={"num_partitions": NUM_PARTITIONS, "urgency_lanes": False, "client_id": name},
        )  # fmt: skip
        self.engine = FakeEngine(model_dir, **engine_options)
        self.worker = Worker(settings, engine_factory=lambda: self.engine)


def is_split_among(members: list[Member]) -> bool:
    return is_split([m.worker for m in members], NUM_PARTITIONS)


async def test_a_backlog_survives_three_workers_replaced_in_turn(broker, tiny_model_dir) -> None:
    """Guards against requests lost in a rolling update: a record committed unanswered when its
    partition moves mid-flight, or dropped on a worker that gained partitions mid-rebalance."""
    started_s = time.monotonic()
    topic, group_id = fresh_topics()
    await create_topic(broker.bootstrap_servers, topic, NUM_PARTITIONS)

    async with (
        Producer(broker.bootstrap_servers) as producer,
        ReplyReader(broker.bootstrap_servers) as replies,
    ):

        def member(name: str, **engine_options) -> Member:
            return Member(
                name, tiny_model_dir, broker.bootstrap_servers, group_id, topic, engine_options
            )  # fmt: skip

        all_replaced = threading.Event()  # the replacements' engines run from then on
        olds = [member(f"old{i}", num_answers=NUM_ANSWERS_BEFORE_STALL) for i in range(NUM_WORKERS)]
        members = list(olds)
        everyone = list(olds)  # stopped at the end, whatever failed
        requests = [
            make_request(replies.topic, f"backlog {n}", id=f"b{n:03d}", max_tokens=MAX_TOKENS)
            for n in range(NUM_REQUESTS)
        ]
        for n, request in enumerate(requests):
            await producer.send_raw(
                topic, encode(request, MSGPACK), request.id.encode(), request_headers(MSGPACK),
                partition=n % NUM_PARTITIONS,
            )  # fmt: skip
        try:
            await asyncio.gather(*(m.worker.start() for m in members))
            await wait_for(
                lambda: is_split_among(members), what="three members splitting the topic"
            )
            for n in range(NUM_WORKERS):
                old = members[n]
                # Stalled with work in flight: what its stop drops is certainly unanswered.
                await wait_for(
                    lambda old=old: old.engine.is_stalled and old.worker.pipeline.num_running,
                    what=f"{old.worker.worker_id} stalled with work in flight",
                )
                new = member(f"new{n}", gate=all_replaced)
                everyone.append(new)
                await new.worker.start()
                await wait_for(
                    lambda new=new: is_split_among([*members, new]), what=f"new{n} joining"
                )
                # The surge moved some of its partitions; others, with work in flight, stay.
                await wait_for(
                    lambda old=old: old.worker.pipeline.num_running,
                    what=f"{old.worker.worker_id} still with work in flight",
                )
                await old.worker.stop(grace_s=GRACE_S)  # what SIGTERM runs
                members[n] = new
                await wait_for(
                    lambda: is_split_among(members), what=f"the group after {n + 1} moves"
                )
            all_replaced.set()
            await replies.wait_until(
                lambda: all(replies.finals(r.id) for r in requests), 60, "every final"
            )
            committed = await wait_for_commit(
                broker.bootstrap_servers, group_id, topic, NUM_PARTITIONS,
                lambda c: all(offset == NUM_REQUESTS // NUM_PARTITIONS for offset in c.values()),
            )  # fmt: skip
        finally:
            await asyncio.gather(
                *(m.worker.stop(grace_s=GRACE_S) for m in everyone if m.worker.consumer),
                return_exceptions=True,
            )
    assert committed == dict.fromkeys(range(NUM_PARTITIONS), NUM_REQUESTS // NUM_PARTITIONS)
    num_finals = Counter({r.id: len(replies.finals(r.id)) for r in requests})
    for request in requests:
        for final in replies.finals(request.id):
            assert final.finish_reason == "length" and final.text == "t" * MAX_TOKENS
    num_duplicates = sum(num_finals.values()) - len(requests)
    print(
        f"\n{len(requests)} requests answered, {num_duplicates} duplicate finals "
        f"(at-least-once); {NUM_WORKERS} replacements in {time.monotonic() - started_s:.1f} s"
    )
    assert min(num_finals.values()) >= 1
    # Each old member answered its few and stalled: the rest was moved, in flight or not.
    assert [m.engine.num_finished for m in olds] == [NUM_ANSWERS_BEFORE_STALL] * NUM_WORKERS
