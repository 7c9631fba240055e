"""Delivery rules of finals: resend on failure, shrink when too large, never ack a lost one
(its delivery's result is the error it was given up on instead)."""

from __future__ import annotations

import asyncio

from opentelemetry.trace import INVALID_SPAN
from structlog.testing import capture_logs

from schemas.codec import decode_reply
from schemas.headers import Urgency
from schemas.messages import Choice, FinalReply, Timing, TokenReply, Usage
from worker.service.job import Job
from worker.service.publisher import DeliveryTimeout
from worker.service.replies import REPLY_TOO_LARGE, ReplyWriter, reply_headers
from worker.service.reply_stream import ReplyStream


class RecordingPublisher:
    """Stands in for the producer: keeps what would be sent, and lets the test ack it."""

    def __init__(self) -> None:
        self.sent = []

    def publish(self, message) -> None:
        self.sent.append(message)


async def settle() -> None:
    """Lets the deliveries' tasks see the outcomes the test just set."""
    for _ in range(5):
        await asyncio.sleep(0)


def make_job() -> Job:
    stream = ReplyStream("r1", "w:1", 1, True)
    return Job(
        request_id="r1", reply_to="mini-infer.replies.c", attempt="w:1", partition=None, offset=7,
        urgency=Urgency.NORMAL, request=None, params=None, span=INVALID_SPAN,
        reply_headers=reply_headers(None), stream=stream, received_s=0.0,
    )  # fmt: skip


def final(text: str) -> FinalReply:
    timing = Timing(queued_ms=0, total_ms=1)
    return FinalReply(
        id="r1",
        attempt="w:1",
        seq=3,
        finish_reason="stop",
        text=text,
        usage=Usage(prompt_tokens=1, completion_tokens=2),
        timing=timing,
    )


async def test_a_failed_final_is_resent_then_given_up_without_an_ack() -> None:
    publisher = RecordingPublisher()
    writer = ReplyWriter(publisher, max_message_bytes=10_000, num_final_retries=2)
    job = make_job()
    outcome = writer.send(job, final("hi"))
    for _ in range(2):
        publisher.sent[-1].on_done(TimeoutError("no broker"))
        await settle()
    assert len(publisher.sent) == 3  # the first try and two retries, all the same message
    assert not outcome.done()
    assert (
        len({m.value for m in publisher.sent}) == 1
        and decode_reply(publisher.sent[0].value).seq == 3
    )
    publisher.sent[-1].on_done(TimeoutError("still none"))
    await settle()
    # Given up after the last retry, never acked: its owner dead-letters it.
    assert len(publisher.sent) == 3 and outcome.done()
    assert str(outcome.result()) == "still none"
    again = writer.send(job, final("again"))
    publisher.sent[-1].on_done(None)
    await settle()
    assert again.done() and again.result() is None


async def test_a_failed_token_message_is_resent_with_its_seq() -> None:
    """Guards against a transient failure of a token message leaving a gap in the stream."""
    publisher = RecordingPublisher()
    writer = ReplyWriter(publisher, max_message_bytes=10_000, num_final_retries=2)
    job = make_job()
    assert writer.send(job, TokenReply(id="r1", attempt="w:1", seq=0, text="a")) is None
    publisher.sent[-1].on_done(TimeoutError("a blip"))
    await settle()
    assert len(publisher.sent) == 2 and publisher.sent[0].value == publisher.sent[1].value
    publisher.sent[-1].on_done(None)
    await settle()
    assert len(publisher.sent) == 2  # acknowledged: nothing more


async def test_a_token_message_is_given_up_after_its_retries_and_a_stuck_topic_at_once() -> None:
    """Tokens are retried from the publisher's callback (no task): the same rule as finals."""
    publisher = RecordingPublisher()
    writer = ReplyWriter(publisher, max_message_bytes=10_000, num_final_retries=2)
    job = make_job()
    with capture_logs() as logs:
        writer.send(job, TokenReply(id="r1", attempt="w:1", seq=4, text="b"))
        for attempt in range(3):
            assert len(publisher.sent) == attempt + 1
            publisher.sent[-1].on_done(TimeoutError(f"blip {attempt}"))
        assert len(publisher.sent) == 3  # the first try and two retries: then given up
        writer.send(job, TokenReply(id="r1", attempt="w:1", seq=5, text="c"))
        publisher.sent[-1].on_done(DeliveryTimeout("stuck"))  # final: not tried again
        assert len(publisher.sent) == 4
    lost = [e for e in logs if e["event"] == "reply.token_lost"]
    assert [e["error"] for e in lost] == [repr(TimeoutError("blip 2")), repr(DeliveryTimeout("stuck"))]
    assert len({decode_reply(m.value).seq for m in publisher.sent[:3]}) == 1


async def test_a_final_too_large_for_the_broker_becomes_a_small_error_final() -> None:
    publisher = RecordingPublisher()
    writer = ReplyWriter(publisher, max_message_bytes=2048, num_final_retries=0)
    writer.send(make_job(), final("x" * 5000))
    choices = [Choice(index=i, text="y" * 1000, finish_reason="stop") for i in range(4)]
    writer.send(make_job(), final("y" * 1000).model_copy(update={"choices": choices}))
    assert len(publisher.sent) == 2
    for message in publisher.sent:  # n > 1: the choices go too
        reply = decode_reply(message.value)
        assert len(message.value) <= 2048 and reply.finish_reason == "error"
        assert reply.error.code == REPLY_TOO_LARGE and reply.seq == 3 and message.key == b"r1"
        assert reply.choices is None
