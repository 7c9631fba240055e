"""Whether a live reader of a partition sees every record while several producers write to it.

On the embedded broker a fetch that races a write from another connection can return a later
batch while an earlier one is still being stored; aiokafka's position then moves past the
earlier batch and a plain reader never reads it. This check writes `--num-records` records
from `--num-producers` processes (three aiokafka producers each, as a worker has) to one
partition, read live by two readers at once: a plain one, and one that fetches offset gaps
again before believing them (`worker/offset_gaps.py`, as every reader in the worker does).
A reader started after the writes counts what the partition holds. Per round it reports what
each live reader missed, and the refetches the guarded one made.

    python -m loadtest.check_live_reads [--rounds 4] [--num-producers 3] [--out r.json]

Not a test: whether the race happens in a run depends on timing (about every second run of
60,000 records on a 2-core VM). The tests make it a fact with the proxy's `hide_batch`.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import sys
import time
from pathlib import Path

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from loadtest.report import emit
from worker.offset_gaps import OffsetGaps, records_of

IDLE_END_S = 3.0  # a reader stops once nothing came for this long after the writers ended


def _produce(servers: str, topic: str, writer: int, num_records: int) -> None:
    async def run() -> None:
        producers = [AIOKafkaProducer(bootstrap_servers=servers, acks="all") for _ in range(3)]
        for producer in producers:
            await producer.start()
        deliveries = []
        for i in range(num_records):
            producer = producers[i % len(producers)]
            value = f"{writer}:{i}".encode()
            deliveries.append(await producer.send(topic, value, partition=0))
            if i % 3 == 0:
                await asyncio.sleep(0.0005)  # let batches form and interleave
        await asyncio.gather(*deliveries)
        for producer in producers:
            await producer.stop()

    asyncio.run(run())


async def _read(servers: str, topic: str, gaps: OffsetGaps | None, writers_done) -> set[bytes]:
    consumer = AIOKafkaConsumer(
        bootstrap_servers=servers, group_id=None, auto_offset_reset="earliest",
        enable_auto_commit=False,
    )  # fmt: skip
    await consumer.start()
    consumer.assign([TopicPartition(topic, 0)])
    seen: set[bytes] = set()
    last_s = time.monotonic()
    try:
        while not (writers_done() and time.monotonic() - last_s > IDLE_END_S):
            batches = await consumer.getmany(timeout_ms=200)
            if batches:
                last_s = time.monotonic()
            if gaps is None:
                records = [r for rs in batches.values() for r in rs]
            else:
                records = list(records_of(consumer, gaps, batches))
            seen.update(r.value for r in records)
    finally:
        await consumer.stop()
    return seen


async def _round(servers: str, num_producers: int, num_records: int) -> dict:
    topic = f"live-reads-{time.time_ns()}"
    admin = AIOKafkaAdminClient(bootstrap_servers=servers)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, 1, 1)])
    finally:
        await admin.close()
    processes = [
        multiprocessing.Process(target=_produce, args=(servers, topic, w, num_records))
        for w in range(num_producers)
    ]
    gaps = OffsetGaps(what="check")

    def writers_done() -> bool:
        return not any(p.is_alive() for p in processes)

    readers = asyncio.gather(
        _read(servers, topic, None, writers_done), _read(servers, topic, gaps, writers_done)
    )
    for process in processes:
        process.start()
    plain, guarded = await readers
    stored = await _read(servers, topic, None, lambda: True)
    return {
        "stored": len(stored),
        "missed_plain": len(stored - plain),
        "missed_guarded": len(stored - guarded),
        "refetches": gaps.num_refetches,
        "gaps_accepted": gaps.num_accepted,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--num-producers", type=int, default=3, help="writer processes")
    parser.add_argument("--num-records", type=int, default=20_000, help="per writer")
    parser.add_argument("--bootstrap-servers", help="a broker to use (default: embedded)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    async def run(servers: str) -> list[dict]:
        rounds = []
        for i in range(args.rounds):
            rounds.append(await _round(servers, args.num_producers, args.num_records))
            print(f"round {i + 1}/{args.rounds}: {rounds[-1]}", file=sys.stderr, flush=True)
        return rounds

    if args.bootstrap_servers:
        rounds = asyncio.run(run(args.bootstrap_servers))
        broker = args.bootstrap_servers
    else:
        from worker.broker import EmbeddedBroker

        with EmbeddedBroker() as embedded:
            rounds = asyncio.run(run(embedded.bootstrap_servers))
        broker = "embedded"
    print(f"\n{'round':>5} {'stored':>8} {'missed plain':>13} {'missed guarded':>15} {'refetches':>10}")
    for i, r in enumerate(rounds):
        print(f"{i + 1:>5} {r['stored']:>8} {r['missed_plain']:>13} {r['missed_guarded']:>15} "
              f"{r['refetches']:>10}")  # fmt: skip
    emit(
        {"broker": broker, "num_producers": args.num_producers, "num_records": args.num_records,
         "load_average": os.getloadavg()[0], "rounds": rounds},
        args.out, None, None,
    )  # fmt: skip
    return 1 if any(r["missed_guarded"] for r in rounds) else 0


if __name__ == "__main__":
    sys.exit(main())
