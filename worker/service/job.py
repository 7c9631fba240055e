"""One attempt at answering one request: what the worker knows about it from consumption to the
broker's acknowledgement of its final."""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.trace import Span

from engine.sampling_params import SamplingParams
from schemas.headers import Urgency
from schemas.messages import Request
from worker.service.reply_stream import ReplyStream


class JobState(enum.Enum):
    PENDING = "pending"  # in the batcher
    RUNNING = "running"  # handed to the engine
    FINISHING = "finishing"  # final published, waiting for the broker's ack
    DONE = "done"  # final acknowledged: its offset may be committed
    DROPPED = "dropped"  # given up without a final (revoked, shutdown): it will be redelivered
    FOLLOWING = "following"  # a duplicate delivery of a request running here: ends with it


@dataclass(eq=False)  # identity semantics: jobs live in sets and dicts
class Job:
    request_id: str
    reply_to: str
    attempt: str  # also the engine's request id: unique even when a request id repeats
    partition: Any  # aiokafka TopicPartition
    offset: int
    urgency: Urgency
    request: Request | None  # None for a request rejected at decoding
    params: SamplingParams | None
    span: Span
    reply_headers: list[tuple[str, bytes]]
    stream: ReplyStream
    received_s: float  # monotonic
    state: JobState = JobState.PENDING
    reply_partition: int | None = None  # v1.2: of reply_to; None: the partitioner picks by key
    prompt_token_ids: list[int] | None = None  # chat template applied, tokenized
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    released_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    finished_s: float | None = None  # the final handed to the publisher
    kafka_wait_s: float | None = None  # producer timestamp -> consumed (a cross-clock hint)
    engine_queue_s: float | None = None  # added to the engine -> its first token's step began
    prefill_s: float | None = None  # that step's duration
    stop_reason: str | None = None  # "cancelled" | "expired" once an engine abort was asked for
    deadline_timer: asyncio.TimerHandle | None = None
    # Awaits the final's delivery and ends the job, once the final is on its way (FINISHING);
    # None before: a job that fails between FINISHING and this has nothing that will ever
    # finish its offset.
    final_outcome: asyncio.Task | None = None
    rendering: asyncio.Future | None = None  # its prompt being tokenized (off the event loop)
    # The consumed record (key, value, headers): dead-lettered as it came if the final can never
    # be delivered, so that its offset is still committed and the request is not lost.
    record: Any = None
    # The assignment epoch its record was consumed in (`OffsetTracker.add`): an ack from another
    # epoch is stale and finishes nothing.
    epoch: Any = None
    memory_bytes: int = 0  # estimated, counted against `limits.max_inflight_bytes`
    # Duplicate deliveries of this request (same id, same content) that arrived while it ran:
    # they are not generated again; their offsets finish with this job's final.
    followers: list[Job] = field(default_factory=list)

    @property
    def deadline_ms(self) -> int | None:
        return self.request.deadline_ms if self.request is not None else None

    @property
    def is_active(self) -> bool:
        return self.state in (JobState.PENDING, JobState.RUNNING)

    def cancel_deadline(self) -> None:
        if self.deadline_timer is not None:
            self.deadline_timer.cancel()
            self.deadline_timer = None
