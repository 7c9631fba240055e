"""How long the broker holds a fetch that new data could answer: produce-to-consume latency of
one message at a time, for each fetch wait, against the embedded broker (or `--bootstrap`).

Apache Kafka answers a waiting fetch as soon as data arrive (`fetch.min.bytes` 1), so its
latency does not grow with the wait; the embedded broker holds an empty fetch for much of its
wait. The worker's busy fetch wait (`fetch_max_wait_busy_ms`) costs a request that arrives
while it works about this much on the embedded broker.

    python -m loadtest.bench_fetch_hold [--waits 20,100,500] [--messages 12] [--bootstrap HOST:PORT]
"""

from __future__ import annotations

import argparse
import asyncio
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


async def run(bootstrap: str, waits: list[int], num_messages: int) -> dict:
    results = {}
    for wait_ms in waits:
        latencies = await hold_ms(bootstrap, wait_ms, num_messages)
        results[str(wait_ms)] = {
            "median_ms": round(statistics.median(latencies), 1),
            "min_ms": round(min(latencies), 1),
            "max_ms": round(max(latencies), 1),
            "latencies_ms": [round(x, 1) for x in latencies],
        }
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--waits", default="20,100,500", help="fetch waits to try, ms")
    parser.add_argument("--messages", type=int, default=12)
    parser.add_argument("--bootstrap", default=None, help="a running broker (default: embedded)")
    parser.add_argument("--out", default=None, help="write the JSON here too")
    args = parser.parse_args(argv)
    waits = [int(w) for w in args.waits.split(",")]
    if args.bootstrap:
        results = asyncio.run(run(args.bootstrap, waits, args.messages))
    else:
        from worker.broker import EmbeddedBroker

        with EmbeddedBroker() as broker:
            results = asyncio.run(run(broker.bootstrap_servers, waits, args.messages))
    print(f"{'fetch wait':>10} {'median':>8} {'min':>8} {'max':>8}  (produce -> consume, ms)")
    for wait, r in results.items():
        print(f"{wait:>10} {r['median_ms']:>8} {r['min_ms']:>8} {r['max_ms']:>8}")
    doc = {"messages": args.messages, "broker": args.bootstrap or "embedded", "by_wait_ms": results}
    from loadtest.report import emit

    emit(doc, None if args.out is None else Path(args.out), None, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
