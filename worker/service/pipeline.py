"""The life of an accepted request on this worker: batcher -> engine -> replies -> final -> ack.

Everything here runs on the event loop; the engine is reached only through the bridge. A job
ends in exactly one of two ways:
- with a final (stop, length, cancelled, expired, error); once the broker acknowledges it, the
  job's offset is finished in the tracker, so the consumer may commit past it;
- dropped, without a final (its partition was revoked, or shutdown ran out of grace): its offset
  stays unfinished, is never committed, and the request is redelivered to the next owner.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, OrderedDict
from collections.abc import Iterable
from typing import Any

import structlog

from engine.outputs import RequestDelta
from schemas.contract import DeadLetterReason
from schemas.messages import ErrorCode, ErrorInfo, Timing, TokenLogprob, TopLogprob, Usage
from worker.service import request_metrics
from worker.service.batcher import Batcher
from worker.service.bridge import (
    Aborted,
    Deltas,
    EngineBridge,
    EngineEvent,
    EngineRequest,
    Failed,
    Restarted,
    StepInfo,
)
from worker.service.bridge import Dropped as EngineDropped
from worker.service.bridge import Rejected as EngineRejected
from worker.service.dead_letters import DeadLetterWriter
from worker.service.job import Job, JobState
from worker.service.job_registry import JobRegistry
from worker.service.offsets import OffsetTracker
from worker.service.prompts import PromptRenderer
from worker.service.replies import ReplyWriter, reply_headers
from worker.service.reply_stream import ReplyStream
from worker.service.routing import Accepted, Rejected, safe_for_log
from worker.service.settings import WorkerSettings
from worker.service.telemetry import Telemetry, end_span, trace_id_of, traceparent_of

log = structlog.get_logger(__name__)

MAX_REMEMBERED_CANCELS = 100_000
# A tokenized prompt held as a Python list: an 8-byte pointer plus, for ids above 256, a 28-byte
# int object each.
BYTES_PER_PROMPT_TOKEN = 40


def _prompt_memory_bound(request) -> int:
    return BYTES_PER_PROMPT_TOKEN * request.num_prompt_chars


def prefill_tokens(num_prompt_tokens: int, n: int, block_size: int) -> int:
    """Tokens the engine computes before every choice of a request has its first token: the
    prompt once, then for each further choice its last block at most (it takes the prompt's
    full blocks from the prefix cache). What the batcher's token budget counts."""
    return num_prompt_tokens + (n - 1) * min(num_prompt_tokens, block_size)


def max_prompt_memory(max_prompt_chars: int) -> int:
    """The most a tokenized prompt can cost: at most about one token per character."""
    return BYTES_PER_PROMPT_TOKEN * max_prompt_chars


class Pipeline:
    def __init__(
        self,
        settings: WorkerSettings,
        worker_id: str,
        bridge: EngineBridge,
        replies: ReplyWriter,
        dead_letters: DeadLetterWriter,
        tracker: OffsetTracker,
        telemetry: Telemetry,
        renderer: PromptRenderer,
        batcher: Batcher,
    ) -> None:
        self._bridge = bridge
        self._replies = replies
        self._dead_letters = dead_letters
        self._tracker = tracker
        self._telemetry = telemetry
        self._renderer = renderer
        self._worker_id = worker_id
        self._tokens_per_message = settings.publisher.tokens_per_message
        self._max_step_tokens = settings.engine.max_num_batched_tokens
        self._block_size = settings.engine.block_size
        self._num_attempts = 0
        self._jobs = JobRegistry(telemetry)  # until DONE or DROPPED
        # Cancels seen for requests not (yet) here: a cancel can overtake its request.
        self._cancelled_ids: OrderedDict[str, None] = OrderedDict()
        self.batcher = batcher  # built with the engine's queue as its budget (the worker)
        batcher.connect(self._release, on_error=self.fail)

    @property
    def num_running(self) -> int:
        return self._jobs.num_running

    @property
    def num_unacked(self) -> int:
        return len(self._jobs)

    @property
    def inflight_bytes(self) -> int:
        """Estimated memory of the jobs not yet answered (the consumer pauses past a budget)."""
        return self._jobs.inflight_bytes

    # --- admission ---------------------------------------------------------------------------

    def accept(
        self, accepted: Accepted, partition: Any, record: Any, received_s: float, epoch: Any = None
    ) -> Job:
        """Queue a valid request, or answer it at once (cancelled before, expired, invalid).

        Total: whatever goes wrong while admitting this one request becomes its error final."""
        job = self._new_job(accepted, partition, record, received_s, epoch)
        try:
            self._admit(job, accepted.request)
        except Exception as error:
            self.fail(job, error)
        return job

    def _admit(self, job: Job, request) -> None:
        leader = self._jobs.running_duplicate_of(job)
        if leader is not None:
            # The same request delivered again (a producer retry, a redelivery after a
            # rebalance) while it runs here: generate it once; this offset finishes with it.
            job.state = JobState.FOLLOWING
            leader.followers.append(job)
            return
        if request.id in self._cancelled_ids:
            self._finish(job, "cancelled")
            return
        # Until tokenized, the prompt's memory is counted at the bound the consumer assumes
        # (a token per character), so that polls meanwhile see it: the byte budget holds.
        self._jobs.add_memory(job, _prompt_memory_bound(request))
        job.rendering = self._renderer.submit(request, job.urgency.priority)
        job.rendering.add_done_callback(lambda rendering: self._on_rendered(job, rendering))

    def _on_rendered(self, job: Job, rendering: asyncio.Future) -> None:
        """Admission, continued once the prompt is tokenized (on the tokenizer thread)."""
        if rendering.cancelled() or job.state is not JobState.PENDING:
            return  # cancelled, dropped or shut down while it was tokenized
        try:
            self._admit_rendered(job, rendering.result())
        except Exception as error:
            self.fail(job, error)

    def _admit_rendered(self, job: Job, rendered) -> None:
        if rendered.error is not None:
            self._finish(job, "error", rendered.error)
        elif self._seconds_to_deadline(job) <= 0:
            self._finish(job, "expired")  # never reaches the engine
        elif self._is_deadline_unreachable(job, self._prefill_tokens(job, len(rendered.token_ids))):
            self._telemetry.expired_at_admission.add(1, {"urgency": job.urgency.value})
            self._finish(job, "expired")  # answered now, before it costs compute or KV blocks
        else:
            job.prompt_token_ids = rendered.token_ids
            job.num_prompt_tokens = len(rendered.token_ids)
            prompt_bytes = BYTES_PER_PROMPT_TOKEN * job.num_prompt_tokens
            self._jobs.add_memory(job, prompt_bytes - _prompt_memory_bound(job.request))
            num_tokens = self._prefill_tokens(job, len(rendered.token_ids))
            self.batcher.submit(job, job.urgency, job.deadline_ms, num_tokens)
            self._arm_deadline(job)

    def reject(
        self, rejected: Rejected, partition: Any, record: Any, received_s: float, epoch: Any = None
    ) -> Job:
        """A request that decoded but is invalid: an error final, nothing else."""
        job = self._new_job(rejected, partition, record, received_s, epoch)
        self._finish(job, "error", ErrorInfo(code=rejected.code, message=rejected.message))
        return job

    def _new_job(
        self,
        decision: Accepted | Rejected,
        partition: Any,
        record: Any,
        received_s: float,
        epoch: Any,
    ) -> Job:
        offset = record.offset
        request = decision.request if isinstance(decision, Accepted) else None
        request_id, urgency = decision.request_id, decision.urgency
        self._num_attempts += 1
        attempt = f"{self._worker_id}:{self._num_attempts}"
        span = self._telemetry.start_request_span(
            partition.topic, request_id, decision.traceparent,
            {"mini_infer.attempt": attempt, "mini_infer.urgency": urgency.value,
             "messaging.kafka.partition": partition.partition, "messaging.kafka.offset": offset},
        )  # fmt: skip
        is_streaming = request.stream if request is not None else False
        job = Job(
            request_id=request_id, reply_to=decision.reply_to,
            reply_partition=decision.reply_partition, attempt=attempt, partition=partition,
            offset=offset, urgency=urgency, request=request, span=span,
            params=decision.params if request is not None else None,
            reply_headers=reply_headers(traceparent_of(span)),
            stream=ReplyStream(
                request_id, attempt, self._tokens_per_message, is_streaming,
                request.nonce if request is not None else decision.nonce,
                num_choices=request.n if request is not None else 1,
            ),
            received_s=received_s, record=record, epoch=epoch,
            kafka_wait_s=request_metrics.kafka_wait_s(record),
        )  # fmt: skip
        self._jobs.add(job)
        request_metrics.on_arrival(self._telemetry, job)
        return job

    def _release(self, jobs: list[Job]) -> None:
        """Batcher callback: in release order (urgency, deadline, arrival)."""
        requests = []
        for job in jobs:
            if not job.is_active:
                continue  # cancelled or expired while it waited (the deadline timer removes it)
            try:  # one bad job fails alone; its batch neighbours still go to the engine
                request = EngineRequest(
                    job.attempt, job.prompt_token_ids, job.params, job.urgency.priority,
                    self._prefill_tokens(job, job.num_prompt_tokens),
                )  # fmt: skip
            except Exception as error:
                self.fail(job, error)
                continue
            job.state = JobState.RUNNING
            job.released_s = time.monotonic()
            requests.append(request)
        if requests:
            self._bridge.submit(requests)

    def _prefill_tokens(self, job: Job, num_prompt_tokens: int) -> int:
        n = job.params.n if job.params is not None else 1
        return prefill_tokens(num_prompt_tokens, n, self._block_size)

    def _seconds_to_deadline(self, job: Job) -> float:
        deadline_ms = job.deadline_ms
        return float("inf") if deadline_ms is None else deadline_ms / 1000 - time.time()

    def predicted_first_token_s(self, urgency_priority: int, num_prompt_tokens: int) -> float:
        """A lower bound on the time to this request's first token: prefilling its prompt and
        every prompt at least as urgent that is ahead of it (held by the batcher or queued in
        the engine), at the step cost model's speed. 0 without a model."""
        model = self._bridge.step_cost
        if model is None:
            return 0.0
        ahead = self._bridge.queued_tokens_at_least_as_urgent_as(urgency_priority)
        ahead += self.batcher.tokens_at_least_as_urgent_as(urgency_priority)
        return model.prefill_ms(ahead + num_prompt_tokens, self._max_step_tokens) / 1000

    def _is_deadline_unreachable(self, job: Job, num_prompt_tokens: int) -> bool:
        if job.deadline_ms is None:
            return False
        predicted_s = self.predicted_first_token_s(job.urgency.priority, num_prompt_tokens)
        is_unreachable = predicted_s > self._seconds_to_deadline(job)
        if is_unreachable:
            log.info(
                "request.deadline_unreachable", request_id=safe_for_log(job.request_id),
                predicted_first_token_ms=round(predicted_s * 1000, 1),
                ms_to_deadline=round(self._seconds_to_deadline(job) * 1000, 1),
            )  # fmt: skip
        return is_unreachable

    def _release_followers(self, leader: Job, is_answered: bool) -> None:
        """The leader ended. Answered (its final acknowledged, or set aside): the duplicates'
        offsets are done too. Not answered (dropped): each duplicate still ours is admitted on
        its own, so that its partition does not wait on a job that will never end here."""
        followers, leader.followers = leader.followers, []
        for job in followers:
            if job.state is not JobState.FOLLOWING:
                continue
            if is_answered:
                job.state = JobState.DONE
                end_span(job.span, "duplicate")
                self._forget(job)
                self._tracker.finish(job.partition, job.offset, job.epoch)
            elif self._tracker.is_current(job.partition, job.epoch):
                job.state = JobState.PENDING
                try:
                    self._admit(job, job.request)
                except Exception as error:
                    self.fail(job, error)
            else:
                job.state = JobState.DROPPED
                job.span.end()
                self._forget(job)

    def _arm_deadline(self, job: Job) -> None:
        """The one place a deadline is enforced once a job is queued: one timer, which stops the
        job wherever it is then (in the batcher or in the engine)."""
        delay_s = self._seconds_to_deadline(job)
        if delay_s != float("inf"):
            job.deadline_timer = asyncio.get_running_loop().call_later(
                max(0.0, delay_s), self._stop, job, "expired"
            )

    # --- engine events -------------------------------------------------------------------------

    async def run_events(self) -> None:
        """Handle the engine's events in order, for the life of the worker."""
        while True:
            event = await self._bridge.events.get()
            try:
                self.on_event(event)
            except Exception:  # a bug: the per-job guards below should have caught it
                log.exception("pipeline.event_failed", event=type(event).__name__)
            self.batcher.wake()  # the engine's queue may have shrunk: maybe there is budget

    def on_event(self, event: EngineEvent) -> None:
        match event:
            case Deltas(deltas, step):
                if step is not None:
                    self._on_step(step)
                self.on_deltas(deltas)
            case EngineRejected(request_id, message, is_prompt_too_long):
                self.on_rejected(request_id, message, is_prompt_too_long)
            case Aborted(request_id):
                self.on_aborted(request_id)
            case Failed(request_ids, message):
                self.on_failed(request_ids, message)
            case Restarted(request_ids):
                self.on_restarted(request_ids)
            case EngineDropped(request_ids, message):
                jobs = [j for j in map(self._jobs.get, request_ids) if j is not None]
                num_dropped = self.drop(jobs, "engine_failed")
                log.error("pipeline.engine_dropped", num_dropped=num_dropped, error=message)

    def _on_step(self, step: StepInfo) -> None:
        request_metrics.on_step(self._telemetry, step)
        for attempt, (queue_s, prefill_s) in step.first_token_times.items():
            job = self._jobs.get(attempt)
            if job is not None:
                job.engine_queue_s, job.prefill_s = queue_s, prefill_s

    def on_deltas(self, deltas: list[RequestDelta]) -> None:
        now_s = time.monotonic()
        gaps: Counter = Counter()  # the step's inter-token gaps, recorded after its deltas
        for delta in deltas:
            job = self._jobs.get(delta.request_id)
            if job is None or job.state is not JobState.RUNNING or job.stop_reason is not None:
                continue  # aborted, dropped or finished meanwhile
            try:  # one job's bad delta must not cost the rest of the batch theirs
                self._on_delta(job, delta, now_s, gaps)
            except Exception as error:
                self.fail(job, error)
        request_metrics.record_gaps(self._telemetry, gaps)

    def _on_delta(self, job: Job, delta: RequestDelta, now_s: float, gaps: Counter) -> None:
        request_metrics.on_tokens(job, len(delta.token_ids), now_s, gaps)
        job.num_prompt_tokens = delta.num_prompt_tokens or job.num_prompt_tokens
        logprobs = _wire_logprobs(delta.token_ids, delta.logprobs, job.params.logprobs)
        reason = (delta.finish_reason or "stop") if delta.finished else None
        messages = job.stream.add(delta.text, delta.token_ids, logprobs, delta.index, reason)
        # Summed over the choices (OpenAI's usage); for n=1 the engine's count.
        job.num_output_tokens = (
            delta.num_output_tokens if job.stream.num_choices == 1
            else job.stream.num_output_tokens
        )  # fmt: skip
        for message in messages:
            self._replies.send(job, message)
        if delta.is_request_finished:
            self._finish(job, job.stream.choice_finish_reason(0) or "stop")

    def on_rejected(self, request_id: str, message: str, is_prompt_too_long: bool = False) -> None:
        job = self._jobs.get(request_id)
        if job is not None and job.is_active:
            code = ErrorCode.PROMPT_TOO_LONG if is_prompt_too_long else ErrorCode.INVALID_REQUEST
            self._finish(job, "error", ErrorInfo(code=code, message=message))

    def on_aborted(self, request_id: str) -> None:
        job = self._jobs.get(request_id)
        if job is not None and job.is_active and job.stop_reason is not None:
            self._finish(job, job.stop_reason)

    def on_restarted(self, request_ids: list[str]) -> None:
        """The engine runs these again from the start (it is isolating a failed step). One that
        already streamed opens a new attempt, as a redelivery would: same seed, so the same
        tokens, and the client's seq/attempt rule hides the repeat."""
        for request_id in request_ids:
            job = self._jobs.get(request_id)
            if job is None or job.state is not JobState.RUNNING or job.stop_reason is not None:
                continue
            if job.stream.num_messages or job.num_output_tokens or job.stream.text:
                self._num_attempts += 1
                attempt = f"{self._worker_id}:{self._num_attempts}"
                job.stream = ReplyStream(
                    job.request_id,
                    attempt,
                    self._tokens_per_message,
                    job.stream.is_streaming,
                    job.stream.nonce,
                    num_choices=job.stream.num_choices,
                )
                job.span.set_attribute("mini_infer.restarted_as", attempt)
            job.num_output_tokens = 0
            job.first_token_s = job.last_token_s = None

    def on_failed(self, request_ids: list[str], message: str) -> None:
        for request_id in request_ids:
            job = self._jobs.get(request_id)
            if job is not None and job.is_active:
                self._finish(job, "error", ErrorInfo(code=ErrorCode.INTERNAL, message=message))

    def fail(self, job: Job, error: BaseException) -> None:
        """A bug while handling this one job: it gets an `error/internal` final (its neighbours
        and the worker go on). If even the final cannot be made, the request is dead-lettered
        as it came, so its offset still moves on."""
        log.error(
            "request.internal_error", request_id=safe_for_log(job.request_id),
            attempt=job.stream.attempt,
            error_type=type(error).__name__, exc_info=error,
        )  # fmt: skip
        try:
            if job.state is JobState.PENDING:
                self.batcher.remove(lambda item: item is job)
            elif job.state is JobState.RUNNING:
                self._bridge.abort(job.attempt)
            if job.is_active:
                message = f"internal error while handling the request ({type(error).__name__})"
                self._finish(job, "error", ErrorInfo(code=ErrorCode.INTERNAL, message=message))
            elif job.state is JobState.FINISHING and job.final_outcome is None:
                # Failed while its final was being made: no final is on its way, and none can
                # be trusted now; dead-lettered below, so its offset still moves on.
                raise RuntimeError("no final on its way")
        except Exception as second:
            log.exception("request.final_failed", request_id=safe_for_log(job.request_id))
            job.cancel_deadline()
            job.state = JobState.DONE
            self._forget(job)
            self._dead_letters.write(
                job.partition, job.record, DeadLetterReason.INTERNAL,
                f"{type(error).__name__}, then {type(second).__name__} making its final",
                epoch=job.epoch,
            )  # fmt: skip

    # --- cancel, expiry, revocation ----------------------------------------------------------

    def cancel(self, request_id: str) -> int:
        """Stop every attempt of `request_id` here; remember the id for a request still to come."""
        self._cancelled_ids[request_id] = None
        self._cancelled_ids.move_to_end(request_id)
        while len(self._cancelled_ids) > MAX_REMEMBERED_CANCELS:
            self._cancelled_ids.popitem(last=False)
        jobs = [j for j in self._jobs.of_request(request_id) if j.is_active]
        for job in jobs:
            self._stop(job, "cancelled")
        return len(jobs)

    def is_cancelled(self, request_id: str) -> bool:
        """Whether a cancel for `request_id` was seen (and is still remembered)."""
        return request_id in self._cancelled_ids

    def _stop(self, job: Job, reason: str) -> None:
        if job.state is JobState.PENDING:
            self.batcher.remove(lambda item: item is job)
            self._finish(job, reason)
        elif job.state is JobState.RUNNING and job.stop_reason is None:
            job.stop_reason = reason  # the final goes out when the engine confirms the abort
            self._bridge.abort(job.attempt)

    def drop(self, jobs: Iterable[Job], why: str) -> int:
        """Give jobs up without a final; their offsets stay uncommitted and are redelivered."""
        num_dropped = 0
        for job in list(jobs):
            if job.state is JobState.FOLLOWING:  # its leader's fate no longer matters to it
                job.state = JobState.DROPPED
                job.span.end()
                self._forget(job)
                continue
            if not job.is_active:
                continue
            if job.state is JobState.PENDING:
                self.batcher.remove(lambda item, j=job: item is j)
            else:
                self._bridge.abort(job.attempt)
            job.state = JobState.DROPPED
            job.cancel_deadline()
            job.span.set_attribute("mini_infer.dropped", why)
            job.span.end()
            self._forget(job)
            self._release_followers(job, is_answered=False)
            num_dropped += 1
        return num_dropped

    def jobs_of(self, partitions: Iterable[Any]) -> list[Job]:
        return self._jobs.jobs_of(partitions)

    def active_jobs(self) -> list[Job]:
        return self._jobs.active()

    # --- the end of a job --------------------------------------------------------------------

    def _finish(self, job: Job, finish_reason: str, error: ErrorInfo | None = None) -> None:
        job.cancel_deadline()
        job.state = JobState.FINISHING
        now_s = job.finished_s = time.monotonic()
        timing = request_metrics.timing_of(job, now_s)
        usage = Usage(prompt_tokens=job.num_prompt_tokens, completion_tokens=job.num_output_tokens)
        for message in job.stream.finish(finish_reason, usage, timing, error):
            delivery = self._replies.send(job, message)  # the last one is the final
        job.final_outcome = asyncio.ensure_future(self._acknowledge(job, delivery))
        self._record(job, finish_reason, timing, error)

    def _record(
        self, job: Job, finish_reason: str, timing: Timing, error: ErrorInfo | None
    ) -> None:
        error_type = error.code if error is not None else None
        request_metrics.on_final(self._telemetry, job, finish_reason, timing, error_type)
        job.span.set_attribute("mini_infer.completion_tokens", job.num_output_tokens)
        log.info(
            "request.finished",
            request_id=safe_for_log(job.request_id),
            attempt=job.stream.attempt,
            partition=job.partition.partition,
            offset=job.offset,
            urgency=job.urgency.value,
            finish_reason=finish_reason,
            error_code=error.code if error else None,
            prompt_tokens=job.num_prompt_tokens,
            completion_tokens=job.num_output_tokens,
            queued_ms=round(timing.queued_ms, 1),
            ttft_ms=None if timing.ttft_ms is None else round(timing.ttft_ms, 1),
            total_ms=round(timing.total_ms, 1),
            trace_id=trace_id_of(job.span),
        )

    async def _acknowledge(self, job: Job, delivery: asyncio.Future) -> None:
        """The end of a job, once its final's delivery is known. Acknowledged: the offset is
        done. Every try failed: left unfinished, the offset would hold back its partition's
        commits until a restart; dead-lettered, the request is kept (replayable from the DLQ)
        and the partition moves on."""
        error = await delivery
        job.state = JobState.DONE
        request_metrics.record_stages(self._telemetry, job, time.monotonic())
        end_span(job.span, "error" if error else (job.stream.finish_reason or "stop"))
        self._forget(job)
        self._release_followers(job, is_answered=True)
        if error is None:
            self._tracker.finish(job.partition, job.offset, job.epoch)
            return
        log.error(
            "final.undeliverable", request_id=safe_for_log(job.request_id),
            attempt=job.stream.attempt,
            reply_to=job.reply_to, error=repr(error),
        )  # fmt: skip
        self._dead_letters.write(
            job.partition, job.record, DeadLetterReason.FINAL_UNDELIVERABLE,
            f"the final to {job.reply_to} failed: {error!r}", epoch=job.epoch,
        )  # fmt: skip

    def _forget(self, job: Job) -> None:
        self._jobs.forget(job)


def _wire_logprobs(token_ids: list[int], positions, top_k: int | None) -> list[TokenLogprob] | None:
    """The engine's per-token logprobs ({token id: Logprob}: the sampled token and the top k)
    as contract v1.1 `TokenLogprob`s: the sampled token's, and the k most likely (which may
    include the sampled one), as in the OpenAI API."""
    if positions is None:
        return None
    out = []
    for token_id, position in zip(token_ids, positions, strict=True):
        ranked = sorted(position.items(), key=lambda item: -item[1].logprob)[: top_k or 0]
        out.append(
            TokenLogprob(
                token_id=token_id,
                logprob=_finite(position[token_id].logprob),
                top_logprobs=[
                    TopLogprob(token_id=tid, logprob=_finite(lp.logprob)) for tid, lp in ranked
                ],
            )
        )
    return out


def _finite(logprob: float) -> float:
    """In [-9999, 0]: the wire refuses infinities (a token the sampler could never pick has -inf),
    and rounding can put a certain token a hair above 0."""
    return max(-9999.0, min(0.0, logprob)) if logprob == logprob else -9999.0
