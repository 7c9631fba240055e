"""Tokenizing a prompt never stops the event loop: while one prompt's tokenization is held (a
gate, standing for a batch of 32,000-character prompts), another request's stream goes on to
its final.

Before the fix the prompt was tokenized on the event loop, so nothing else ran until it was done:
the other stream's final came only after the gate opened (here a safety valve opens it after
`VALVE_S`, so that the old code fails instead of hanging). The engine takes no step past its
third until the held tokenization has started, so the other stream is certainly still running
then: a fact, not a matter of speed.
"""

from __future__ import annotations

import threading

import pytest

from tests.worker.kafka_helpers import (
    SMALL_ENGINE,
    create_topic,
    fresh_topics,
    make_request,
    serving,
    wait_for,
    worker_settings,
)
from worker.service.prompts import PromptRenderer
from worker.service.worker import Worker

pytestmark = pytest.mark.kafka

VALVE_S = 60.0
OTHER_MAX_TOKENS = 16
NUM_FREE_STEPS = 3


class WaitingEngine:
    """The real engine; past `NUM_FREE_STEPS` steps, each step first waits for `event`."""

    def __init__(self, engine, event: threading.Event) -> None:
        self._engine, self._event, self._num_steps = engine, event, 0

    def step(self):
        self._num_steps += 1
        if self._num_steps > NUM_FREE_STEPS:
            self._event.wait(VALVE_S)
        return self._engine.step()

    def __getattr__(self, name: str):
        return getattr(self._engine, name)


async def test_a_held_tokenization_does_not_stop_another_stream(
    broker, tiny_model_dir, monkeypatch
) -> None:
    gate, started, holding = threading.Event(), threading.Event(), threading.Event()
    render = PromptRenderer.render

    def held_render(self, request):
        if request.prompt == "held":
            holding.set()
            started.set()
            gate.wait(VALVE_S)
            holding.clear()
        return render(self, request)

    def engine_factory():
        from engine import LLMEngine

        return WaitingEngine(LLMEngine(str(tiny_model_dir), **SMALL_ENGINE), started)

    monkeypatch.setattr(PromptRenderer, "render", held_render)
    topic, group_id = fresh_topics()
    await create_topic(broker.bootstrap_servers, topic, 1)
    settings = worker_settings(tiny_model_dir, broker.bootstrap_servers, group_id, topic)
    worker = Worker(settings, engine_factory=engine_factory)
    try:
        async with serving(broker, worker, grace_s=0) as (producer, replies):
            other = make_request(
                replies.topic, "other", id="other", max_tokens=OTHER_MAX_TOKENS, ignore_eos=True
            )
            await producer.send(topic, other)
            await replies.wait_until(lambda: replies.tokens(other.id), what="the other's tokens")
            await producer.send(topic, make_request(replies.topic, "held", id="held"))
            await wait_for(started.is_set, 60, "the held tokenization to start")
            final = await replies.final_of(other.id, VALVE_S * 2)
            assert holding.is_set(), "the other stream waited for the held tokenization"
            assert final.usage.completion_tokens == OTHER_MAX_TOKENS
            gate.set()
            assert (await replies.final_of("held")).finish_reason == "length"
    finally:
        gate.set()
