"""How long the broker holds a fetch that new data could answer: produce-to-consume latency of
one message at a time, for each fetch wait, against the embedded broker (or `--bootstrap`).

Apache Kafka answers a waiting fetch as soon as data arrive (`fetch.min.bytes` 1), so its
latency does not grow with the wait; the embedded broker holds an empty fetch for much of its
wait. The worker's busy fetch wait (`fetch_max_wait_busy_ms`) costs a request that arrives
while it works about this much on the embedded broker.

And what an idle consumer's empty fetches cost, per wait: `--idle-s` seconds of a consumer
polling a topic of `--partitions` partitions with nothing in it, its CPU (this process: nothing
else runs in it meanwhile) and the embedded broker's, per second and per fetch (an empty fetch
is held for the whole wait, so there are about idle time / wait of them). On two cores these
land beside the engine: a client's reply consumer and a worker's request consumer poll all the
time.

And what a produce request costs (`--produce N`): N messages of `--produce-bytes`, each sent
alone and awaited (acks=all, no linger: one stream's tokens, a request each), the producer's CPU
and the broker's per request. A worker streaming one request sends about one such request a
token, and on two cores the broker's share lands beside the engine.

    python -m loadtest.bench_fetch_hold [--waits 20,100,500] [--messages 12] [--idle-s 5]
                                        [--partitions 1] [--produce 0] [--bootstrap HOST:PORT]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import sys
import time
from pathlib import Path


async def hold_ms(bootstrap: str, wait_ms: int, num_messages: int) -> list[float]:
    """Produce one message at a random moment, `num_messages` times; the ms until the consumer
    (fetch wait `wait_ms`) had each."""
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    topic = f"fetch-hold-{wait_ms}-{random.randrange(1 << 30)}"
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=bootstrap, fetch_max_wait_ms=wait_ms,
        auto_offset_reset="earliest", group_id=None,
    )  # fmt: skip
    try:
        await producer.send_and_wait(topic, b"first")  # creates the topic
        await consumer.start()
        while not any((await consumer.getmany(timeout_ms=1000)).values()):
            pass
        latencies = []
        for _ in range(num_messages):
            await asyncio.sleep(random.uniform(0.05, 0.3))  # a random phase of the held fetch
            sent = time.perf_counter()
            await producer.send_and_wait(topic, b"x")
            while not any((await consumer.getmany(timeout_ms=2000)).values()):
                pass
            latencies.append((time.perf_counter() - sent) * 1000)
        return latencies
    finally:
        await consumer.stop()
        await producer.stop()


async def idle_cost(
    bootstrap: str, wait_ms: int, idle_s: float, num_partitions: int, broker_pid: int | None
) -> dict:
    """CPU per second and per fetch of a consumer (fetch wait `wait_ms`) polling an empty topic
    of `num_partitions` partitions for `idle_s`, and of the broker where its pid is known."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    from loadtest.bench_e2e import cpu_seconds
    from loadtest.loadgen_service import create_bench_topics

    def broker_cpu_s() -> float:
        return cpu_seconds(broker_pid) if broker_pid else 0.0

    topic = f"fetch-idle-{wait_ms}-{random.randrange(1 << 30)}"
    await create_bench_topics(bootstrap, {topic: num_partitions})
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, fetch_max_wait_ms=wait_ms, group_id=None,
        enable_auto_commit=False,
    )  # fmt: skip
    await consumer.start()
    consumer.assign([TopicPartition(topic, p) for p in range(num_partitions)])

    async def poll() -> None:
        while True:
            await consumer.getmany(timeout_ms=1000)

    poller = asyncio.create_task(poll())
    try:
        await asyncio.sleep(1.0)  # connected, fetching
        cpu_before, broker_before, started = time.process_time(), broker_cpu_s(), time.monotonic()
        await asyncio.sleep(idle_s)
        elapsed = time.monotonic() - started
        consumer_s, broker_s = time.process_time() - cpu_before, broker_cpu_s() - broker_before
    finally:
        poller.cancel()
        await asyncio.gather(poller, return_exceptions=True)
        await consumer.stop()
    fetches = elapsed * 1000 / wait_ms
    result = {
        "consumer_cpu_per_s": round(consumer_s / elapsed, 4),
        "consumer_ms_per_fetch": round(consumer_s * 1000 / fetches, 3),
    }
    if broker_pid:
        result["broker_cpu_per_s"] = round(broker_s / elapsed, 4)
        result["broker_ms_per_fetch"] = round(broker_s * 1000 / fetches, 3)
    return result


async def produce_cost(
    bootstrap: str, num_requests: int, num_bytes: int, broker_pid: int | None
) -> dict:
    """CPU per produce request of one message each, sent one after another and awaited: this
    process's (the producer's) and the broker's where its pid is known."""
    from aiokafka import AIOKafkaProducer

    from loadtest.bench_e2e import cpu_seconds

    topic = f"produce-cost-{random.randrange(1 << 30)}"
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=0)
    await producer.start()
    try:
        await producer.send_and_wait(topic, b"first")  # creates the topic
        value = b"x" * num_bytes
        cpu_before, started = time.process_time(), time.monotonic()
        broker_before = cpu_seconds(broker_pid) if broker_pid else 0.0
        for _ in range(num_requests):
            await producer.send_and_wait(topic, value)
        elapsed = time.monotonic() - started
        producer_s = time.process_time() - cpu_before
        broker_s = cpu_seconds(broker_pid) - broker_before if broker_pid else 0.0
    finally:
        await producer.stop()
    result = {
        "requests": num_requests,
        "ms_per_request": round(elapsed * 1000 / num_requests, 3),
        "producer_us_per_request": round(producer_s * 1e6 / num_requests, 1),
    }
    if broker_pid:
        result["broker_us_per_request"] = round(broker_s * 1e6 / num_requests, 1)
    return result


async def run(
    bootstrap: str, waits: list[int], num_messages: int, idle_s: float = 0.0,
    num_partitions: int = 1, broker_pid: int | None = None,
) -> dict:  # fmt: skip
    results = {}
    for wait_ms in waits:
        latencies = await hold_ms(bootstrap, wait_ms, num_messages)
        results[str(wait_ms)] = {
            "median_ms": round(statistics.median(latencies), 1),
            "min_ms": round(min(latencies), 1),
            "max_ms": round(max(latencies), 1),
            "latencies_ms": [round(x, 1) for x in latencies],
        }
        if idle_s > 0:
            results[str(wait_ms)]["idle"] = await idle_cost(
                bootstrap, wait_ms, idle_s, num_partitions, broker_pid
            )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--waits", default="20,100,500", help="fetch waits to try, ms")
    parser.add_argument("--messages", type=int, default=12)
    parser.add_argument("--bootstrap", default=None, help="a running broker (default: embedded)")
    parser.add_argument("--idle-s", type=float, default=5.0, help="0: no idle cost measured")
    parser.add_argument("--partitions", type=int, default=1, help="of the idle topic")
    parser.add_argument("--produce", type=int, default=0, help="produce requests to time (0: none)")
    parser.add_argument("--produce-bytes", type=int, default=200, help="each message's size")
    parser.add_argument("--out", default=None, help="write the JSON here too")
    args = parser.parse_args(argv)
    waits = [int(w) for w in args.waits.split(",")]
    with contextlib.ExitStack() as stack:
        bootstrap, broker_pid = args.bootstrap, None
        if bootstrap is None:
            from worker.broker import EmbeddedBroker

            broker = stack.enter_context(EmbeddedBroker())
            bootstrap, broker_pid = broker.bootstrap_servers, broker.pid
        results = asyncio.run(
            run(bootstrap, waits, args.messages, args.idle_s, args.partitions, broker_pid)
        )
        produce = (
            asyncio.run(produce_cost(bootstrap, args.produce, args.produce_bytes, broker_pid))
            if args.produce > 0
            else None
        )
    print(f"{'fetch wait':>10} {'median':>8} {'min':>8} {'max':>8}  (produce -> consume, ms)")
    for wait, r in results.items():
        print(f"{wait:>10} {r['median_ms']:>8} {r['min_ms']:>8} {r['max_ms']:>8}")
    if args.idle_s > 0:
        print(f"\nidle, {args.partitions} partition(s): CPU per second of polling, and per fetch")
        print(f"{'fetch wait':>10} {'consumer':>9} {'broker':>8} {'consumer ms':>12} "
              f"{'broker ms':>10}")  # fmt: skip
        for wait, r in results.items():
            idle = r["idle"]
            print(f"{wait:>10} {idle['consumer_cpu_per_s']:>9.4f} "
                  f"{idle.get('broker_cpu_per_s', float('nan')):>8.4f} "
                  f"{idle['consumer_ms_per_fetch']:>12.3f} "
                  f"{idle.get('broker_ms_per_fetch', float('nan')):>10.3f}")  # fmt: skip
    if produce is not None:
        print(f"\nproduce requests of one {args.produce_bytes}-byte message, awaited one by one "
              f"({produce['requests']}): {produce['ms_per_request']} ms each; CPU per request: "
              f"producer {produce['producer_us_per_request']} us, broker "
              f"{produce.get('broker_us_per_request', 'not known')} us")  # fmt: skip
    doc = {"messages": args.messages, "broker": args.bootstrap or "embedded",
           "idle_s": args.idle_s, "idle_partitions": args.partitions, "by_wait_ms": results,
           **({"produce": produce} if produce is not None else {})}  # fmt: skip
    from loadtest.report import emit

    emit(doc, None if args.out is None else Path(args.out), None, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
