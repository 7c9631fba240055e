"""Other clients' token latency while one reply topic refuses writes (issue 18, item 2).

A `serve` worker (tiny random model unless `--model`) reaches the embedded broker through the
fault-injecting proxy (tests/worker/kafka_proxy.py). Each round sends `--num-stuck` requests
whose replies go to one client's own topic, then `--num-others` requests of other clients (on
the shared reply topic, the SDK's default, or with `--others-on private` on a topic of their
own), and reads the others' streams as they arrive. The two sides differ only in that topic:
- `baseline`: it accepts writes;
- `stuck`: the proxy answers every produce to it with NOT_ENOUGH_REPLICAS (retriable: what a
  topic created with replication factor 1 gets where `min.insync.replicas=2`), so its replies
  wait in the worker until the delivery deadline dead-letters them.
Per round: the p50/p99 gap between consecutive messages of the others' streams and their p99
time to first token. The sides alternate for `--rounds` rounds; medians are compared (target:
stuck p99 under 2x baseline). The machine is shared: `uptime` is recorded per round.
`--num-private-producers 0` runs the worker with one producer for every topic (as before
issue 18's isolation of per-client topics).

    python -m loadtest.bench_stuck_reply --rounds 3 [--num-private-producers 0]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from schemas.codec import decode_reply
from schemas.contract import DEFAULT_SHARED_REPLY_TOPIC, NUM_SHARED_REPLY_TOPIC_PARTITIONS
from schemas.headers import read_content_type
from schemas.messages import FinalReply
from tests.conftest import unique_name
from tests.worker.kafka_helpers import PREFIX, Producer, create_topic, make_request
from tests.worker.kafka_proxy import KafkaProxy
from tests.worker.workers import kill, start_serve, wait_for_file
from worker.broker import EmbeddedBroker
from worker.topic_reader import TopicReader

SIDES = ("baseline", "stuck")
TARGET_RATIO = 2.0
SLOW_GAP_MS = 80.0


class TimedReader:
    """Reads topics from the start; keeps each reply's arrival time (monotonic s), per id."""

    def __init__(self, bootstrap_servers: str, topics: list[str]) -> None:
        self._reader = TopicReader(
            bootstrap_servers, self._on_record, topics=topics, fetch_max_wait_ms=5
        )
        self.arrivals: dict[str, list[tuple[float, object]]] = defaultdict(list)
        self.keys: dict[str, set[str]] = defaultdict(set)  # topic -> record keys read

    async def __aenter__(self) -> TimedReader:
        await self._reader.__aenter__()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self._reader.__aexit__(*exc_info)

    def _on_record(self, record) -> None:
        arrived_s = time.monotonic()
        self.keys[record.topic].add(record.key.decode() if record.key else "")
        with contextlib.suppress(Exception):  # a DLQ record is not a reply
            reply = decode_reply(record.value, read_content_type(record.headers))
            self.arrivals[reply.id].append((arrived_s, reply))

    def has_final(self, request_id: str) -> bool:
        return any(isinstance(r, FinalReply) for _, r in self.arrivals.get(request_id, ()))


async def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline_s = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline_s:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def run_round(args, side: str, index: int, env: dict) -> dict:
    """One round on the running worker: the stuck client's requests, then the others'."""
    servers, proxy, topic = env["servers"], env["proxy"], env["topic"]
    stuck_topic = PREFIX + unique_name(f"stuck-{side}")
    await create_topic(servers, stuck_topic, 1)
    if side == "stuck":
        proxy.fail_produce(stuck_topic)
    load = _uptime()
    long = {"max_tokens": args.max_tokens, "ignore_eos": True}
    stuck = [make_request(stuck_topic, f"stuck {index} {n}", **long) for n in range(args.num_stuck)]
    if args.others_on == "shared":  # each client reads its own partition of it
        long["reply_partition"] = 0
    others = [
        make_request(env["others_topic"], f"other {index} {n}", **long)
        for n in range(args.num_others)
    ]
    async with TimedReader(servers, [env["others_topic"], stuck_topic, env["dlq"]]) as reader:
        producer: Producer = env["producer"]
        for request in stuck:
            await producer.send(topic, request)
        sent_s = {}
        for request in others:
            sent_s[request.id] = time.monotonic()
            await producer.send(topic, request)
        await wait_until(
            lambda: all(reader.has_final(r.id) for r in others), args.timeout_s, "others' finals"
        )
        # The stuck client's requests end before the next round: answered, or dead-lettered.
        await wait_until(
            lambda: all(
                reader.has_final(r.id) or r.id in reader.keys[env["dlq"]] for r in stuck
            ),
            args.timeout_s + args.delivery_timeout_s, "the stuck client's requests to end",
        )  # fmt: skip
    proxy.failing_topics.pop(stuck_topic, None)
    gaps_ms, ttfts_ms = [], []
    for request in others:
        times = sorted(t for t, _ in reader.arrivals[request.id])
        ttfts_ms.append((times[0] - sent_s[request.id]) * 1e3)
        gaps_ms += [(b - a) * 1e3 for a, b in zip(times, times[1:], strict=False)]
    return {
        "side": side,
        "round": index,
        "uptime": load,
        "num_gaps": len(gaps_ms),
        "gap_p50_ms": round(percentile(gaps_ms, 0.50), 2),
        "gap_p99_ms": round(percentile(gaps_ms, 0.99), 2),
        "ttft_p99_ms": round(percentile(ttfts_ms, 0.99), 1),
        # aiokafka's retry backoff (100 ms) shows as gaps of about that: how much of the round
        # a refused topic throttled the others
        "slow_gap_share": round(sum(g >= SLOW_GAP_MS for g in gaps_ms) / max(1, len(gaps_ms)), 3),
        "num_stuck_dead_lettered": sum(1 for r in stuck if r.id in reader.keys[env["dlq"]]),
    }


async def bench(args) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp_dir, EmbeddedBroker() as broker:
        tmp = Path(tmp_dir)
        model_dir = Path(args.model) if args.model else _tiny_model(tmp)
        servers = broker.bootstrap_servers
        topic, group_id = unique_name("bench-req"), unique_name("bench-group")
        await create_topic(servers, topic, args.num_partitions)
        if args.others_on == "shared":
            others_topic = DEFAULT_SHARED_REPLY_TOPIC
            await create_topic(servers, others_topic, NUM_SHARED_REPLY_TOPIC_PARTITIONS)
        else:
            others_topic = PREFIX + unique_name("others")
            await create_topic(servers, others_topic, 1)
        async with KafkaProxy(servers) as proxy, Producer(servers) as producer:
            process = start_serve(
                proxy.bootstrap_servers, model_dir, group_id, topic, tmp / "ready",
                tmp / "serve.log", "bench", args.num_partitions,
                extra_env={
                    "MINI_INFER_PUBLISHER__DELIVERY_TIMEOUT_S": str(args.delivery_timeout_s),
                    "MINI_INFER_KAFKA__URGENCY_LANES": "false",
                    "MINI_INFER_PUBLISHER__NUM_PRIVATE_PRODUCERS": str(args.num_private_producers),
                },
            )  # fmt: skip
            try:
                await wait_for_file(tmp / "ready", process, tmp / "serve.log", 180)
                env = {
                    "servers": servers, "proxy": proxy, "topic": topic, "producer": producer,
                    "others_topic": others_topic, "dlq": topic + ".dlq",
                }  # fmt: skip
                await run_round(args, "baseline", -1, env)  # warm-up: not recorded
                for index in range(args.rounds):
                    for side in SIDES if index % 2 == 0 else SIDES[::-1]:
                        rows.append(await run_round(args, side, index, env))
                        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            finally:
                kill(process)
    return rows


def summarize(rows: list[dict]) -> dict:
    summary = {}
    for side in SIDES:
        mine = [r for r in rows if r["side"] == side]
        summary[side] = {
            key: statistics.median(r[key] for r in mine)
            for key in ("gap_p50_ms", "gap_p99_ms", "slow_gap_share", "ttft_p99_ms")
        }
    base, stuck = summary["baseline"]["gap_p99_ms"], summary["stuck"]["gap_p99_ms"]
    summary["gap_p99_ratio"] = round(stuck / base, 2) if base else None
    summary["ttft_p99_ratio"] = round(
        summary["stuck"]["ttft_p99_ms"] / summary["baseline"]["ttft_p99_ms"], 2
    )
    summary["is_within_target"] = summary["gap_p99_ratio"] is not None and (
        summary["gap_p99_ratio"] < TARGET_RATIO
    )
    return summary


def print_table(rows: list[dict], summary: dict) -> None:
    print(
        f"{'side':<9} {'round':>5} {'gap p50':>9} {'gap p99':>9} {'slow':>6} {'ttft p99':>9} "
        f"{'dlq':>4}  load"
    )
    for r in rows:
        print(
            f"{r['side']:<9} {r['round']:>5} {r['gap_p50_ms']:>9.2f} {r['gap_p99_ms']:>9.2f} "
            f"{r['slow_gap_share']:>6.3f} {r['ttft_p99_ms']:>9.1f} {r['num_stuck_dead_lettered']:>4}  "
            f"{r['uptime'].split('load average:')[-1].strip()}"
        )
    print(
        f"median gap p99: stuck/baseline = {summary['gap_p99_ratio']}x "
        f"(target < {TARGET_RATIO}x); ttft p99 = {summary['ttft_p99_ratio']}x"
    )


def _tiny_model(tmp: Path) -> Path:
    from tests.tiny_model import make_tiny_llama

    return make_tiny_llama(tmp / "tiny-llama")


def _uptime() -> str:
    with contextlib.suppress(OSError):
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    return ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each runs both sides")
    parser.add_argument("--num-others", type=int, default=8, help="other clients' requests")
    parser.add_argument("--num-stuck", type=int, default=4, help="the stuck client's requests")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--num-partitions", type=int, default=4)
    parser.add_argument("--delivery-timeout-s", type=float, default=5.0)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--others-on", choices=("shared", "private"), default="shared")
    parser.add_argument("--num-private-producers", type=int, default=2)
    parser.add_argument("--model", default=None, help="a model directory (default: tiny random)")
    args = parser.parse_args()
    rows = asyncio.run(bench(args))
    summary = summarize(rows)
    print_table(rows, summary)
    print(json.dumps({"runs": rows, "summary": summary, "args": vars(args)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
