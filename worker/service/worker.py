"""The composition root: builds a worker from its settings and owns its start-up and shutdown.

Start-up, in dependency order: topics, producer, engine (its thread; the model loads), prompt
tokenizer, batcher and the pipeline it feeds, cancel listener, request consumer (joins the group),
ready.

Shutdown, in the order that loses nothing (at-least-once), all of it within `stop_budget_s`
(below the pod's grace period: a stop that overruns it is a SIGKILL that commits nothing):
1. stop polling: no new messages are taken;
2. stop admitting: requests still in the batcher are dropped (never started: cheap to redo);
3. drain: requests in the engine may finish within `shutdown_grace_s`, and within what the
   budget leaves after the reserve for the steps below;
4. abort what is left, without a final: its offset stays uncommitted, so it is redelivered;
5. commit the watermarks: what is acknowledged already is safe before anything slow happens;
6. flush the producer, bounded (a topic that refuses writes must not hold the stop), and
   commit again what the flush acknowledged;
7. close, each part bounded by what is left: cancel listener, consumer (leaves the group, so
   the rebalance starts at once), engine thread, producer, admin, telemetry.

`mini-infer serve` runs one worker until SIGTERM/SIGINT against the configured Kafka; it starts an
embedded broker only when asked to (`--embedded-broker`, for development).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import os
import secrets
import signal
import socket
import sys
import threading
import time

import structlog
from aiokafka.errors import KafkaError

from engine.cpus import cpu_budget
from schemas.codec import Limits
from worker.broker import BrokerError, EmbeddedBroker
from worker.service.batcher import Batcher
from worker.service.bridge import EngineBridge
from worker.service.consumer import RequestConsumer
from worker.service.control import CancelListener
from worker.service.dead_letters import DeadLetterWriter
from worker.service.health import Health
from worker.service.offsets import OffsetTracker
from worker.service.pipeline import Pipeline
from worker.service.prompts import PromptRenderer
from worker.service.publisher import Publisher
from worker.service.replies import ReplyWriter
from worker.service.routing import RoutingPolicy
from worker.service.settings import WorkerSettings
from worker.service.telemetry import Telemetry
from worker.service.topics import TopicAdmin

log = structlog.get_logger(__name__)

DRAIN_POLL_S = 0.05
TOPIC_CHECK_INTERVAL_S = 15.0
# Of the stop budget, kept for the steps after the drain: commit, flush, commit, close.
STOP_RESERVE_FRACTION = 0.5
MIN_CLOSE_S = 0.5  # each closer gets at least this, even when the budget is spent
NO_BROKER_MESSAGE = (
    "no Kafka configured: set MINI_INFER_KAFKA__BOOTSTRAP_SERVERS (or --bootstrap-servers); "
    "for development only, --embedded-broker (MINI_INFER_KAFKA__EMBEDDED_BROKER=true) starts an "
    "in-memory broker"
)


def make_worker_id() -> str:
    return f"{socket.gethostname()[:32]}-{os.getpid()}-{secrets.token_hex(3)}"


def default_engine_factory(settings: WorkerSettings):
    def build():
        from engine import LLMEngine

        config = dataclasses.asdict(settings.engine)
        return LLMEngine(
            settings.model, dtype=settings.dtype, quantization=settings.quantization,
            revision=settings.revision, **config,
        )  # fmt: skip

    return build


def served_model_names(
    configured: str, model_path: str, served_name: str | None = None
) -> frozenset[str]:
    """Names a request's `model` may use for what this worker serves: the served name alone
    when one is set (the deployment chose it), else the configured model and its path."""
    if served_name is not None:
        return frozenset({served_name})
    path = model_path.rstrip("/")
    base = os.path.basename(path)
    return frozenset({configured, path, base, base.removesuffix(".gguf")})


class Worker:
    def __init__(
        self,
        settings: WorkerSettings,
        bootstrap_servers: str | None = None,
        *,
        engine_factory=None,
        telemetry: Telemetry | None = None,
    ) -> None:
        self.settings = settings
        self.bootstrap_servers = bootstrap_servers or settings.kafka.bootstrap_servers
        if self.bootstrap_servers is None:
            raise ValueError("a Worker needs bootstrap servers (serve() starts an embedded broker)")
        self.worker_id = settings.worker_id or make_worker_id()
        self.telemetry = telemetry or Telemetry(
            settings.observability, self.worker_id,
            model_name=settings.model_name, group_id=settings.kafka.group_id,
        )  # fmt: skip
        self._engine_factory = engine_factory or default_engine_factory(settings)
        obs = settings.observability
        registry = self.telemetry.prometheus_registry if obs.prometheus else None
        self.health = Health(obs.health_port, obs.ready_file, self, registry)
        self.topics: TopicAdmin | None = None
        self.publisher: Publisher | None = None
        self.bridge: EngineBridge | None = None
        self.pipeline: Pipeline | None = None
        self.consumer: RequestConsumer | None = None
        self.cancels: CancelListener | None = None
        self.renderer: PromptRenderer | None = None
        self.tracker = OffsetTracker()
        self._tasks: list[asyncio.Task] = []
        self.failed = asyncio.Event()  # a background task died: the worker cannot go on

    async def start(self) -> None:
        """Start everything; on failure, close what was started and raise."""
        try:
            await self._start()
        except BaseException:
            await self._close()
            raise

    async def _start(self) -> None:
        s, kafka = self.settings, self.settings.kafka
        log_ = log.bind(worker_id=self.worker_id)
        await self.health.start()
        self.topics = TopicAdmin(self.bootstrap_servers, kafka)
        await self.topics.start()
        await self.topics.create(self._own_topics())
        self.publisher = Publisher(s, self.bootstrap_servers)
        await self.publisher.start()
        started_s = time.monotonic()
        self.bridge = EngineBridge(self._engine_factory, s.limits.max_consecutive_step_failures)
        info = await self.bridge.start()
        # after the engine's threads were started
        lower_thread_priority(*loop_priority(s.event_loop_nice, s.event_loop_policy, cpu_budget()))
        if info.stats is not None:
            self.telemetry.observe_engine(info.stats)  # KV blocks known before any request
        log_.info(
            "worker.engine_loaded",
            model=info.model_path,
            load_s=round(time.monotonic() - started_s, 2),
        )
        tokenizer = await asyncio.to_thread(_load_tokenizer, info.model_path)
        limits = Limits(
            max_message_bytes=s.limits.max_message_bytes, max_prompt_chars=s.limits.max_prompt_chars
        )
        replies = ReplyWriter(
            self.publisher, s.limits.max_message_bytes, s.publisher.num_final_retries
        )
        renderer = self.renderer = PromptRenderer(tokenizer)
        dead_letters = DeadLetterWriter(
            self.publisher, self.tracker, self.telemetry, kafka.dlq_topic,
            s.publisher.num_final_retries, s.limits.max_message_bytes, self._fail,
        )  # fmt: skip
        batcher = Batcher(s.batcher, queued_tokens=self.bridge.queued_tokens_at_least_as_urgent_as)
        self.pipeline = Pipeline(
            s, self.worker_id, self.bridge, replies, dead_letters, self.tracker, self.telemetry,
            renderer, batcher,
        )  # fmt: skip
        names = served_model_names(s.model, info.model_path, s.served_model_name)
        policy = RoutingPolicy(limits, kafka.reply_topic_prefix, names)
        self.cancels = CancelListener(kafka, self.bootstrap_servers, self.pipeline, limits)
        await self.cancels.start()
        self.consumer = RequestConsumer(
            s,
            self.bootstrap_servers,
            self.pipeline,
            self.publisher,
            dead_letters,
            self.topics,
            policy,
            self.telemetry,
            self.tracker,
        )
        await self.consumer.start()
        self._spawn(batcher.run(), "batcher")
        self._spawn(self.pipeline.run_events(), "engine-events")
        self._spawn(self._watch_engine(), "engine-watch")
        self._spawn(self.cancels.run(), "cancels")
        self._spawn(self.consumer.run(), "consumer")
        self._spawn(self._watch_topics(), "topics")
        self._spawn(self._sample_kafka(), "kafka-gauges")
        self._spawn(self._watch_publisher(), "publisher-watch")
        self.health.set_ready(
            True, worker_id=self.worker_id, model=s.model_name, group_id=kafka.group_id
        )

    def _fail(self, error: BaseException) -> None:
        """A fault the worker cannot serve through (the DLQ unwritable, the engine failing step
        after step): stop being ready at once; `serve` then stops and exits non-zero."""
        log.error("worker.failed", error=repr(error))
        self.health.set_ready(False)
        self.failed.set()

    async def _watch_publisher(self) -> None:
        await self.publisher.failed.wait()
        self._fail(RuntimeError("the publisher task died"))

    async def _watch_engine(self) -> None:
        error = await self.bridge.crashed
        log.error("worker.engine_crashed", error=repr(error))
        self.failed.set()

    # --- health probes (Health asks) and Kafka gauges -------------------------------------------

    def liveness(self) -> dict[str, bool]:
        """The event loop answers (this runs on it) and the engine thread makes progress."""
        stall_s = self.settings.observability.engine_stall_s
        return {"engine_thread": self.bridge is not None and self.bridge.is_alive(stall_s)}

    def readiness(self) -> dict[str, bool]:
        """Started and able to work: the model loaded and warmed up (asked only then), the engine
        thread alive, the consumer running, and the broker answering its polls. Holding
        partitions is not a condition: with as many replicas as partitions a surge pod holds
        none until the old pod leaves, and a rollout that waited for it would never finish
        (`mini_infer.consumer.partitions.assigned` shows who holds what)."""
        consumer = self.consumer
        last_poll_s = consumer.last_poll_ok_s if consumer is not None else None
        stale_s = self.settings.observability.broker_stale_s
        return {
            "engine_thread": self.bridge is not None and self.bridge.is_alive(float("inf")),
            "consumer_running": self._is_task_running("consumer"),
            "broker_reachable": last_poll_s is not None
            and time.monotonic() - last_poll_s < stale_s,
        }

    def _is_task_running(self, prefix: str) -> bool:
        return any(t.get_name().startswith(prefix + "-") and not t.done() for t in self._tasks)

    async def _sample_kafka(self) -> None:
        state = self.telemetry.kafka_state
        while True:
            consumer = self.consumer
            if consumer is not None:
                state.lags = {(p.topic, p.partition): lag for p, lag in consumer.lags().items()}
                state.num_paused = consumer.num_paused
                state.num_assigned = len(consumer.assignment)
            await asyncio.sleep(self.settings.observability.kafka_sample_interval_s)

    def _own_topics(self) -> dict[str, int]:
        kafka = self.settings.kafka
        topics = dict.fromkeys(
            (*kafka.request_topics, kafka.control_topic, kafka.dlq_topic), kafka.num_partitions
        )
        if kafka.num_shared_reply_partitions > 0:
            topics[kafka.shared_reply_topic_name] = kafka.num_shared_reply_partitions
        return topics

    async def _watch_topics(self) -> None:
        """Every `TOPIC_CHECK_INTERVAL_S`: recreate the worker's topics if the broker lost them.
        Also the outage log: aiokafka's clients retry a lost broker quietly (with their own
        backoff, `retry_backoff_ms` and `reconnect_backoff_ms`: no busy loop), so this check is
        where an outage is named once, when it starts, and again when it ends."""
        outage_since_s = None
        while True:
            await asyncio.sleep(TOPIC_CHECK_INTERVAL_S)
            try:
                await self.topics.refresh(self._own_topics())
            except (KafkaError, OSError) as error:
                log.warning("worker.topic_check_failed", error=repr(error))
                if outage_since_s is None:
                    outage_since_s = time.monotonic()
                    log.error("worker.broker_unreachable", error=repr(error))
                continue
            if outage_since_s is not None:
                log.warning(
                    "worker.broker_reachable",
                    outage_s=round(time.monotonic() - outage_since_s, 1),
                )
                outage_since_s = None

    def _spawn(self, coro, name: str) -> None:
        task = asyncio.create_task(coro, name=f"{name}-{self.worker_id}")
        task.add_done_callback(self._on_task_done)
        self._tasks.append(task)

    def _on_task_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("worker.task_died", task=task.get_name(), error=repr(task.exception()))
            self.failed.set()

    async def wait_assigned(self, timeout_s: float = 60.0) -> None:
        """Until the group gave this worker partitions (a join takes seconds; tests wait here)."""
        deadline_s = time.monotonic() + timeout_s
        while not self.consumer.assignment:
            if time.monotonic() > deadline_s:
                raise TimeoutError(f"worker {self.worker_id} got no partitions in {timeout_s} s")
            await asyncio.sleep(0.05)

    async def stop(self, grace_s: float | None = None) -> None:
        """The ordered shutdown described in the module docstring."""
        grace_s = self.settings.shutdown_grace_s if grace_s is None else grace_s
        budget_s = self.settings.stop_budget_s
        deadline_s = time.monotonic() + budget_s
        self.health.set_ready(False)
        if self.consumer is not None:
            self.consumer.stop_polling()
            await self._wait_for_task("consumer")
        num_lost = 0
        if self.pipeline is not None:
            num_lost += self.pipeline.drop(self.pipeline.batcher.drain(), "shutdown")
            drain_until_s = min(
                time.monotonic() + grace_s, deadline_s - budget_s * STOP_RESERVE_FRACTION
            )
            while self.pipeline.num_running and time.monotonic() < drain_until_s:
                await asyncio.sleep(DRAIN_POLL_S)
            num_lost += self.pipeline.drop(self.pipeline.active_jobs(), "shutdown")
        await self._commit_within(deadline_s)  # what is acknowledged already, first
        if self.publisher is not None:  # then a bounded flush, and what it acknowledged
            left_s = deadline_s - time.monotonic()
            await self.publisher.flush(timeout_s=max(0.0, left_s / 3))
            await self._commit_within(deadline_s)
        log.info("worker.drained", worker_id=self.worker_id, num_redelivered=num_lost)
        await self._close(deadline_s)

    async def _commit_within(self, deadline_s: float) -> None:
        if self.consumer is None:
            return
        try:
            await asyncio.wait_for(
                self.consumer.commit(), max(MIN_CLOSE_S, deadline_s - time.monotonic())
            )
        except TimeoutError:
            log.warning("worker.commit_timeout")

    async def abort(self) -> None:
        """Die like a crashed pod: nothing drained, nothing committed (tests of redelivery)."""
        self.health.set_ready(False)
        if self.consumer is not None:
            self.consumer.stop_polling()
        if self.pipeline is not None:
            self.pipeline.drop(self.pipeline.batcher.drain(), "abort")
            self.pipeline.drop(self.pipeline.active_jobs(), "abort")
        await self._close()

    async def _wait_for_task(self, prefix: str) -> None:
        for task in self._tasks:
            if task.get_name().startswith(prefix + "-"):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await asyncio.wait_for(asyncio.shield(task), 5.0)

    async def _close(self, deadline_s: float | None = None) -> None:
        """Close every part; with `deadline_s`, each is given what is left (at least
        `MIN_CLOSE_S`) and abandoned past it, so that the process can still exit."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        for closer in (
            self.cancels.close if self.cancels else None,
            self.consumer.close if self.consumer else None,
            self.bridge.stop if self.bridge else None,
            self.publisher.stop if self.publisher else None,
            self.topics.close if self.topics else None,
            self.health.close,
        ):
            if closer is None:
                continue
            left_s = None if deadline_s is None else deadline_s - time.monotonic()
            try:
                await asyncio.wait_for(
                    closer(), None if left_s is None else max(MIN_CLOSE_S, left_s)
                )
            except TimeoutError:
                log.warning("worker.close_timeout", part=getattr(closer, "__qualname__", ""))
            except Exception:  # keep closing the rest
                log.exception(
                    "worker.close_failed", part=getattr(closer, "__qualname__", str(closer))
                )
        if self.renderer is not None:
            self.renderer.close()
        self.cancels = self.consumer = self.bridge = self.publisher = self.topics = None
        self.renderer = None
        self.telemetry.shutdown()
        log.info("worker.stopped", worker_id=self.worker_id)


def _load_tokenizer(model_path: str):
    from engine.loader import load_tokenizer

    return load_tokenizer(model_path)


async def serve(settings: WorkerSettings, stop: asyncio.Event | None = None) -> int:
    """Run one worker until SIGTERM/SIGINT (or `stop` is set); 0 after a clean shutdown."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        async with contextlib.AsyncExitStack() as stack:
            bootstrap_servers = settings.kafka.bootstrap_servers
            if bootstrap_servers is None and not settings.kafka.embedded_broker:
                raise ValueError(NO_BROKER_MESSAGE)
            if bootstrap_servers is None:
                broker = EmbeddedBroker(port=settings.kafka.embedded_port)
                bootstrap_servers = (await stack.enter_async_context(broker)).bootstrap_servers
                print(f"embedded broker on {bootstrap_servers}", file=sys.stderr, flush=True)
            worker = Worker(settings, bootstrap_servers)
            await worker.start()
            freeze_start_up_heap()  # the process is the worker's (tests run several in theirs)
            try:
                return await _run_until_stopped(worker, stop)
            finally:
                gc.unfreeze()  # what start-up built may be garbage now: collectable again
    # Start-up failures a user can fix (no such model, broker unreachable, port taken): one
    # clear line, not a traceback. Worker.start has already closed what it had opened.
    except (ValueError, BrokerError, OSError, KafkaError) as error:
        log.error("worker.start_failed", error=str(error) or repr(error))
        print(f"mini-infer serve: cannot start: {error}", file=sys.stderr, flush=True)
        return 1
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)


async def _run_until_stopped(worker: Worker, stop: asyncio.Event) -> int:
    waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(worker.failed.wait())]
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for waiter in waiters:
        waiter.cancel()
    log.info("worker.stopping", reason="signal" if stop.is_set() else "task failure")
    await worker.stop()
    return 1 if worker.failed.is_set() else 0


def freeze_start_up_heap() -> None:
    """Move what start-up built (torch, the model's modules, the tokenizer, aiokafka's and
    OpenTelemetry's objects: ~225k tracked objects) out of the garbage collector's sight.

    Why: a full collection walks every tracked object with the GIL held, and the engine thread
    needs the GIL between steps, so every stream's next token waits for it. CPython runs one
    whenever a quarter as many objects as its oldest generation holds have survived into it
    since the last; a worker serving W2 met one in 45 s, and it stalled the loop 154 ms (124
    ms of CPU). Frozen, start-up's objects are never walked again (nor freed, should they
    become cyclic garbage: they live as long as the worker), and the quarter is counted from
    what is left: full collections every ~8 s of W2, 5-12 ms of CPU each (14-38 ms with the
    loop preempted). Measured with `gc.callbacks` in the worker (loadtest/JOURNAL.md).
    The log line gives a full collection's time before the freeze (it also frees start-up's
    garbage) and after it."""
    started_s = time.perf_counter()
    gc.collect()
    before_ms = (time.perf_counter() - started_s) * 1e3
    gc.freeze()
    started_s = time.perf_counter()
    gc.collect()
    after_ms = (time.perf_counter() - started_s) * 1e3
    log.info(
        "worker.heap_frozen", num_objects=gc.get_freeze_count(),
        full_collection_ms=round(before_ms, 1), full_collection_frozen_ms=round(after_ms, 1),
    )  # fmt: skip


def loop_priority(niceness: int, policy: str, num_cpus: int) -> tuple[int, str]:
    """The event loop's nice value and policy on a worker that may use `num_cpus` CPUs: as
    configured where the engine leaves the loop room (two CPUs or more: its steps' threads
    sleep at barriers, or one thread leaves a core), else as the engine's (0, "normal"). With
    one CPU, the engine's thread computes without sleeping while it generates, and a loop at
    nice 19 or under SCHED_IDLE got the CPU about once a second: one stream's tokens reached the
    client in a single burst at the end (`bench e2e --worker-cpus 0`, loadtest/JOURNAL.md)."""
    if num_cpus >= 2:
        return niceness, policy
    if niceness > 0 or policy != "normal":
        log.info("worker.loop_priority_kept", num_cpus=num_cpus, reason="one CPU: the engine "
                 "would leave the event loop none")  # fmt: skip
    return 0, "normal"


def lower_thread_priority(niceness: int, policy: str = "normal") -> None:
    """The calling thread (not the process: Linux nice values and scheduling policies are per
    thread) at `niceness`, and under SCHED_IDLE when `policy` is "idle"; threads it starts later
    inherit both, the engine's already-running ones keep theirs."""
    if sys.platform != "linux":
        return
    tid = threading.get_native_id()
    if niceness > 0:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, niceness)
        except OSError as error:  # e.g. already nicer than that, without the right to go back
            log.warning("worker.loop_priority_unchanged", niceness=niceness, error=str(error))
        else:
            log.info("worker.loop_priority", niceness=niceness)
    if policy == "idle":
        try:  # lowering a thread's own policy needs no privilege
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except OSError as error:
            log.warning("worker.loop_policy_unchanged", policy=policy, error=str(error))
        else:
            log.info("worker.loop_policy", policy=policy)
