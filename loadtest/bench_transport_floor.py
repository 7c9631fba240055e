"""What streaming tokens through Kafka costs an engine on the same cores, with no worker: the
transport's floor under `bench e2e`'s ratios.

`mini-infer bench e2e --num-requests 1` compares one stream through the worker with the direct
engine; the gap has stayed at ~1.2x on two cores, against a target of 1.1x. This bench asks how
much of it the transport alone costs: the direct engine generates one stream (or `--num-streams`)
while, on the same cores, a producer sends one message per token it generates (as the worker's reply path does, one
Kafka message per token), the embedded broker takes it, and a consumer reads it (as the client
SDK does). Nothing of the worker runs: no pipeline, no batcher, no reply encoding. If the
engine's inter-token latency beside that alone is already more than 10% above its own, no work
on the worker meets the target on these cores; what is left is a cheaper transport or other
cores for it.

Sides (the engine is built once; the sides alternate for `--rounds`, each with a fresh broker):
- `none`: the engine alone (the baseline of every ratio);
- `process`: the producer in a process of its own (aiokafka, `acks=all`, `linger_ms=0`, one
  `send` per token, as `Publisher` does), told of each step's tokens through a pipe; the broker and the
  consumer at nice 19 as `bench e2e` runs them; the producer at nice 19 under SCHED_IDLE, as the
  worker's event loop runs;
- `thread`: the same producer on an event loop in a thread of the engine's process, handed each
  step's tokens by `call_soon_threadsafe` (the worker's layout: the loop shares the GIL with the
  engine);
- `rdkafka`: the `process` side with confluent-kafka's producer (librdkafka) in place of
  aiokafka's, where confluent-kafka is importable (it is not a dependency of this project: the
  side is there to price a reply path on librdkafka: loadtest/JOURNAL.md).

Each round reports the engine's mean gap between a stream's tokens after its first and its
throughput, their ratios to the `none` run of the same round, the messages the consumer read
(every token's, or the round says so), and the CPU time the broker, producer and consumer took
per token (the scheduler's per-thread clocks, /proc's 10 ms ticks where it keeps none; the
producer on the `thread` side by its thread's clock).
Medians over the rounds, a table, the JSON, and with `--plot` every round's ratios by side.
`mini-infer bench e2e --floor` runs one round of the `thread` side after each of its pairs.

With `--task-times`, each run also reads the fused decode step's per-task clocks (the ones
`mini-infer bench engine --profile` reads): the seconds its threads spent in the tasks and
waiting at the barriers after them, summed over the threads, by kind of task (where other work
on the cores stalls the step). While the clocks run the thread choice is off: every step runs
on all the threads.

    python -m loadtest.bench_transport_floor [--sides none,process,thread] [--rounds 6]
        [--num-streams 1] [--num-tokens 256] [--fetch-wait-ms 20] [--task-times]
        [--out r.json] [--plot r.png]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import multiprocessing
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import msgpack

from loadtest.bench_e2e import cpu_seconds, lower_priority
from loadtest.loadgen_service import create_bench_topics
from loadtest.profile_step import run_with_task_clocks
from loadtest.report import emit
from worker.client.client import DEFAULT_REPLY_FETCH_MAX_WAIT_MS

SIDES = ("none", "process", "thread", "rdkafka")
TOPIC = "floor.replies"
# A token message's shape on the wire (a TokenReply's fields, msgpack).
VALUE = msgpack.packb({
    "v": "1", "type": "token", "id": "bench-0", "attempt": "worker-1:1", "seq": 7,
    "text": " the", "token_ids": [1000], "nonce": "0123456789abcdef0123456789abcdef",
})  # fmt: skip
HEADERS = [("content-type", b"application/msgpack")]


def _lower_this_thread() -> None:
    """The calling thread at nice 19 under SCHED_IDLE: the worker's event loop's default."""
    from worker.service.worker import lower_thread_priority

    lower_thread_priority(19, "idle")


class _AiokafkaSender:
    """One `send` per token on an event loop, each with a callback on its delivery (as
    `Publisher` has)."""

    def __init__(self, bootstrap: str) -> None:
        from aiokafka import AIOKafkaProducer

        self.producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=0)

    async def start(self) -> None:
        await self.producer.start()

    async def send(self, stream: int) -> None:
        delivery = await self.producer.send(
            TOPIC, VALUE, key=b"r%d" % stream, headers=HEADERS, partition=0
        )
        delivery.add_done_callback(_delivered)

    async def stop(self) -> None:
        await self.producer.stop()


def _delivered(_future) -> None:
    """The per-delivery callback (`Publisher` has one for every message); the consumer's count
    is what checks delivery."""


async def _produce_from_pipe(bootstrap: str, read_fd: int, ready, rdkafka: bool) -> None:
    """The `process` and `rdkafka` sides' producer: a message per byte read from the pipe."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    if rdkafka:
        from confluent_kafka import Producer

        producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0, "acks": "all"})

        def send(stream: int) -> None:
            producer.produce(TOPIC, VALUE, key=b"r%d" % stream, headers=HEADERS, partition=0)
            producer.poll(0)  # delivery callbacks: none registered, but the queue is served

        async def serve() -> None:  # librdkafka's acks come back on its own threads
            while not done.done():
                producer.poll(0)
                await asyncio.sleep(0.005)

        server = asyncio.create_task(serve())
    else:
        sender = _AiokafkaSender(bootstrap)
        await sender.start()

        def send(stream: int) -> None:
            loop.create_task(sender.send(stream))

    def on_readable() -> None:
        data = os.read(read_fd, 4096)
        if not data:  # the engine closed its end: the run is over
            loop.remove_reader(read_fd)
            done.set_result(None)
            return
        for stream in data:
            send(stream)

    loop.add_reader(read_fd, on_readable)
    ready.set()
    await done
    if rdkafka:
        await server
        producer.flush(10)
    else:
        await sender.stop()


def _consumer_child(bootstrap: str, ready, stop, consumed, fetch_wait_ms: int) -> None:
    """Reads the topic as the client SDK reads its reply partition, decoding each value;
    `consumed` (a shared counter) counts the messages read."""

    async def consume() -> None:
        from aiokafka import AIOKafkaConsumer, TopicPartition

        consumer = AIOKafkaConsumer(
            bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
            auto_offset_reset="earliest", fetch_max_wait_ms=fetch_wait_ms,
        )  # fmt: skip
        await consumer.start()
        consumer.assign([TopicPartition(TOPIC, 0)])
        ready.set()
        while not stop.is_set():
            batches = await consumer.getmany(timeout_ms=100)
            for records in batches.values():
                for record in records:
                    msgpack.unpackb(record.value)
                    consumed.value += 1
        await consumer.stop()

    asyncio.run(consume())


class _ThreadProducer:
    """The `thread` side: the producer's loop in a thread of this process, lowered as the
    worker lowers its loop; the engine hands it each step's tokens with `call_soon_threadsafe`."""

    def __init__(self, bootstrap: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._bootstrap = bootstrap
        self.sender: _AiokafkaSender | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="floor-loop", daemon=True)
        self._thread.start()
        self._ready.wait(60)

    def _run(self) -> None:
        _lower_this_thread()
        asyncio.set_event_loop(self.loop)

        async def start() -> None:  # aiokafka's clients are made on their running loop
            self.sender = _AiokafkaSender(self._bootstrap)
            await self.sender.start()

        self.loop.run_until_complete(start())
        self._ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self.sender.stop())

    def on_step(self, streams: list[int]) -> None:
        if streams:
            self.loop.call_soon_threadsafe(self._send, streams)

    def cpu_s(self) -> float:
        """The loop thread's CPU time so far (read on that thread)."""
        import concurrent.futures

        result: concurrent.futures.Future[float] = concurrent.futures.Future()
        self.loop.call_soon_threadsafe(lambda: result.set_result(time.thread_time()))
        return result.result(10)

    def _send(self, streams: list[int]) -> None:
        for stream in streams:
            self.loop.create_task(self.sender.send(stream))

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)


def _generate(engine, prompts: list, num_tokens: int, on_step) -> dict:
    """`len(prompts)` streams of `num_tokens` greedy tokens each; `on_step(streams)` is told,
    once per step, which streams got a token in it (the bridge hands the loop a step's deltas
    at once). The mean gap between a stream's tokens after its first, and the throughput over
    the whole run (prefill included, as `bench e2e` counts it)."""
    from engine import SamplingParams

    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    times: dict[str, list[float]] = {}
    while engine.has_unfinished_requests():
        streams = []
        for delta in engine.step():
            now = time.perf_counter()
            times.setdefault(delta.request_id, []).extend([now] * len(delta.token_ids))
            streams.extend([int(delta.request_id)] * len(delta.token_ids))
        on_step(streams)
    elapsed = time.perf_counter() - start
    num = sum(len(t) for t in times.values())
    gaps = [(t[-1] - t[0]) / (len(t) - 1) for t in times.values() if len(t) > 1]
    return {
        "itl_ms": round(statistics.mean(gaps) * 1000, 3),
        "tokens_per_s": round(num / elapsed, 1),
        "num_tokens": num,
    }


def _run_side(
    side: str, engine, prompts: list, num_tokens: int,
    fetch_wait_ms: int = DEFAULT_REPLY_FETCH_MAX_WAIT_MS,
) -> dict:  # fmt: skip
    from worker.broker import EmbeddedBroker

    if side == "none":
        return _generate(engine, prompts, num_tokens, lambda streams: None)
    spawn = multiprocessing.get_context("spawn")
    with EmbeddedBroker() as broker:
        bootstrap = broker.bootstrap_servers
        asyncio.run(create_bench_topics(bootstrap, {TOPIC: 1}))
        lower_priority(broker.pid)
        consumer_ready, stop, consumed = spawn.Event(), spawn.Event(), spawn.Value("q", 0)
        consumer = spawn.Process(
            target=_consumer_child, args=(bootstrap, consumer_ready, stop, consumed, fetch_wait_ms)
        )
        producer = thread_producer = write_fd = None
        try:
            consumer.start()
            consumer_ready.wait(60)
            lower_priority(consumer.pid)
            pids = {"broker": broker.pid, "consumer": consumer.pid}
            if side == "thread":
                thread_producer = _ThreadProducer(bootstrap)
                on_step = thread_producer.on_step
            else:
                read_fd, write_fd = os.pipe()
                producer_ready = spawn.Event()
                # A spawned child does not inherit descriptors: it is handed the pipe's read end.
                producer = _spawn_with_fd(spawn, bootstrap, read_fd, producer_ready, side)
                producer_ready.wait(60)
                os.close(read_fd)
                pids["producer"] = producer.pid

                def on_step(streams: list[int], fd: int = write_fd) -> None:
                    if streams:
                        os.write(fd, bytes(i % 256 for i in streams))

            time.sleep(0.5)  # the children's start-up off the cores before the measured run
            before = {name: cpu_seconds(pid) for name, pid in pids.items()}
            own_before = thread_producer.cpu_s() if thread_producer is not None else 0.0
            result = _generate(engine, prompts, num_tokens, on_step)
            # Every token's message read (a side that lost messages would look cheap), and
            # the CPU of sending and reading the last ones counted.
            deadline = time.monotonic() + 10
            while consumed.value < result["num_tokens"] and time.monotonic() < deadline:
                time.sleep(0.01)
            result["messages_read"] = consumed.value
            cpu = {
                name: cpu_seconds(pid) - before[name]
                for name, pid in pids.items()
            }  # fmt: skip
            if thread_producer is not None:
                cpu["producer"] = thread_producer.cpu_s() - own_before
        finally:
            if thread_producer is not None:
                thread_producer.close()
            if write_fd is not None:
                os.close(write_fd)  # the producer's end of the run
            if producer is not None:
                producer.join(30)
                producer.kill()
            stop.set()
            consumer.join(30)
            consumer.kill()
    num = result["num_tokens"]
    return {**result, "cpu_us_per_token": {k: round(v / num * 1e6, 1) for k, v in cpu.items()}}


def _with_task_times(engine, run) -> dict:
    """`run()`'s result with the fused decode step's clocks over it: `task_work_s` and
    `task_wait_s`, seconds summed over the threads, in all and by kind of task (the plan's
    task names). Nothing added where the engine has no fused step."""
    fused = getattr(engine.runner._forward, "fused", None)
    if fused is None:
        return run()
    result, tasks = run_with_task_clocks(fused.plan, fused.task_names, run)
    kinds: dict[str, list[float]] = {}
    for name, w, b in tasks:
        kind = kinds.setdefault(name, [0.0, 0.0])
        kind[0] += sum(w) / 1e9
        kind[1] += sum(b) / 1e9
    by_wait = sorted(kinds.items(), key=lambda item: -item[1][1])
    result["task_work_s"] = round(sum(k[0] for k in kinds.values()), 3)
    result["task_wait_s"] = round(sum(k[1] for k in kinds.values()), 3)
    result["task_wait_s_by_kind"] = {name: round(k[1], 3) for name, k in by_wait}
    return result


def _spawn_with_fd(spawn, bootstrap: str, read_fd: int, ready, side: str):
    """A spawned producer child that gets `read_fd` (spawn closes inherited descriptors unless
    they are passed)."""
    from multiprocessing import reduction

    parent, child = spawn.Pipe()
    process = spawn.Process(target=_fd_child, args=(bootstrap, child, ready, side == "rdkafka"),
                            daemon=True)  # fmt: skip
    process.start()
    reduction.send_handle(parent, read_fd, process.pid)
    return process


def _fd_child(bootstrap: str, conn, ready, rdkafka: bool) -> None:
    """The producer child: takes the pipe's read end, lowers itself as the worker's loop is."""
    from multiprocessing import reduction

    read_fd = reduction.recv_handle(conn)
    _lower_this_thread()
    asyncio.run(_produce_from_pipe(bootstrap, read_fd, ready, rdkafka))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sides", default="none,process,thread")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--num-streams", type=int, default=1, help="32: W2's shape")
    parser.add_argument("--num-tokens", type=int, default=256, help="per stream")
    parser.add_argument(
        "--fetch-wait-ms", type=int, default=DEFAULT_REPLY_FETCH_MAX_WAIT_MS,
        help="the consumer's fetch_max_wait_ms (default: the client SDK's)",
    )  # fmt: skip
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--kv-cache-dtype", default=None)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument(
        "--task-times", action="store_true",
        help="the fused step's work and barrier waits per kind of task (thread choice off)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path)
    parser.add_argument("--plot", type=Path, help="each round's ratios by side (a PNG)")
    args = parser.parse_args(argv)
    sides = [s for s in args.sides.split(",") if s]
    unknown = set(sides) - set(SIDES)
    if unknown:
        parser.error(f"unknown sides {sorted(unknown)}; known: {', '.join(SIDES)}")
    if "none" not in sides:
        sides.insert(0, "none")
    if "rdkafka" in sides:
        try:
            import confluent_kafka  # noqa: F401
        except ImportError:
            parser.error("the rdkafka side needs confluent-kafka importable (PYTHONPATH): it is "
                         "not a dependency of this project")  # fmt: skip

    from engine import LLMEngine
    from loadtest.workloads import ENGINE_OPTIONS, chat_prompts

    options = {**ENGINE_OPTIONS, "dtype": args.dtype}
    for key in ("quantization", "kv_cache_dtype", "num_threads"):
        if getattr(args, key) is not None:
            options[key] = getattr(args, key)
    engine = LLMEngine(args.model, **options)
    prompts = chat_prompts(engine.tokenizer, args.num_streams)
    _generate(engine, prompts, 16, lambda streams: None)  # warm-up
    rounds: list[dict] = []
    for round_ in range(args.rounds):
        order = sides if round_ % 2 == 0 else sides[::-1]  # neither side always first
        results = {}
        for side in order:
            run = functools.partial(
                _run_side, side, engine, prompts, args.num_tokens, args.fetch_wait_ms
            )
            results[side] = _with_task_times(engine, run) if args.task_times else run()
        none = results["none"]
        for result in results.values():
            result["itl_ratio"] = round(result["itl_ms"] / none["itl_ms"], 3)
            result["throughput_ratio"] = round(result["tokens_per_s"] / none["tokens_per_s"], 3)
        rounds.append(results)
        lost = {s: r["messages_read"] for s, r in results.items() if "messages_read" in r
                and r["messages_read"] != r["num_tokens"]}  # fmt: skip
        if lost:
            print(f"round {round_ + 1}: messages read short of the tokens: {lost}",
                  file=sys.stderr)  # fmt: skip
        print(f"round {round_ + 1}/{args.rounds}: " + ", ".join(
            f"{side} ITL {r['itl_ms']:.2f} ms ({r['itl_ratio']:.3f}x) "
            f"{r['tokens_per_s']:.0f} tok/s ({r['throughput_ratio']:.3f}x)"
            + (f" waits {r['task_wait_s']:.2f} s of {r['task_work_s']:.2f} s "
               f"({_top_waits(r)})" if "task_wait_s" in r else "")
            for side, r in results.items()
        ), file=sys.stderr, flush=True)  # fmt: skip
    medians = {}
    for side in sides:
        runs = [r[side] for r in rounds]
        medians[side] = {
            key: round(statistics.median(r[key] for r in runs), 3)
            for key in ("itl_ms", "itl_ratio", "tokens_per_s", "throughput_ratio")
        }
        for key in ("task_work_s", "task_wait_s"):
            if key in runs[0]:
                medians[side][key] = round(statistics.median(r[key] for r in runs), 3)
        for name in runs[0].get("cpu_us_per_token", {}):
            medians[side][f"{name}_us_per_token"] = round(
                statistics.median(r["cpu_us_per_token"][name] for r in runs), 1
            )
    workload = f"{args.num_streams} stream(s) x {args.num_tokens} tokens"
    print(f"\n{workload}, medians of {args.rounds} rounds; CPU beside the engine, us a token")
    print(f"{'side':8} {'ITL ms':>7} {'/ none':>7} {'tok/s':>7} {'/ none':>7} {'broker':>7} "
          f"{'consumer':>9} {'producer':>9}")  # fmt: skip
    for side, m in medians.items():
        print(f"{side:8} {m['itl_ms']:7.2f} {m['itl_ratio']:7.3f} {m['tokens_per_s']:7.0f} "
              f"{m['throughput_ratio']:7.3f} {m.get('broker_us_per_token', 0):7.0f} "
              f"{m.get('consumer_us_per_token', 0):9.0f} "
              f"{m.get('producer_us_per_token', 0):9.0f}")  # fmt: skip
    doc = {
        "workload": workload,
        "consumer_fetch_wait_ms": args.fetch_wait_ms,
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg()[0],
        "medians": medians,
        "rounds": rounds,
    }
    emit(doc, args.out, args.plot, lambda plt: _draw(doc, plt))
    return 0


def _top_waits(result: dict, count: int = 4) -> str:
    """The kinds of task with the longest barrier waits, "name seconds" each."""
    kinds = list(result["task_wait_s_by_kind"].items())[:count]
    return ", ".join(f"{name} {seconds:.2f}" for name, seconds in kinds)


def _draw(doc: dict, plt):
    """Each round's ratio to the engine alone, by side: inter-token latency and throughput."""
    sides = [side for side in doc["medians"] if side != "none"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in (
        (axes[0], "itl_ratio", "inter-token latency / engine alone (lower is better)"),
        (axes[1], "throughput_ratio", "throughput / engine alone (higher is better)"),
    ):
        for x, side in enumerate(sides):
            values = [r[side][key] for r in doc["rounds"]]
            ax.scatter([x] * len(values), values, alpha=0.6)
            ax.hlines(doc["medians"][side][key], x - 0.3, x + 0.3, colors="black")
        ax.axhline(1.0, color="grey", linestyle=":")
        ax.set_xticks(range(len(sides)), sides)
        ax.set_title(label, fontsize=9)
    fig.suptitle(f"{doc['workload']}: the Kafka transport beside the engine, no worker "
                 f"(rounds; bars: medians)", fontsize=10)  # fmt: skip
    return fig


if __name__ == "__main__":
    sys.exit(main())
