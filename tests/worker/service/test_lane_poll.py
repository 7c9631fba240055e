"""A poll hands out the urgency lanes' records before the base topic's, whatever order aiokafka
fetched them in. No broker: a fake consumer with aiokafka 0.14's `fetched_records` rule (the
buffered partitions in the order their fetches came back, up to `max_records` in all, only the
partitions asked for)."""

from __future__ import annotations

from aiokafka import TopicPartition
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.service.consumer import poll_lanes_first

BASE = [TopicPartition("mini-infer.requests", p) for p in range(2)]
CRITICAL = TopicPartition("mini-infer.requests.critical", 0)
HIGH = TopicPartition("mini-infer.requests.high", 0)


class BufferedConsumer:
    def __init__(self, buffered: dict[TopicPartition, list[str]]) -> None:
        self.buffered = {tp: list(records) for tp, records in buffered.items()}
        self.waits_ms: list[int] = []

    async def getmany(self, *partitions, timeout_ms=0, max_records=None):
        self.waits_ms.append(timeout_ms)
        drained = {}
        for tp in list(self.buffered):
            if partitions and tp not in partitions:
                continue
            records = self.buffered[tp][:max_records]
            del self.buffered[tp][: len(records)]
            if not self.buffered[tp]:
                del self.buffered[tp]
            if records:
                drained[tp] = records
                max_records -= len(records)
                if max_records == 0:
                    break
        return drained


async def test_a_critical_record_buffered_behind_the_read_ahead_comes_first() -> None:
    """aiokafka alone (the old poll) returned 10 low records here, and the critical one only
    polls later, after the rest of the buffered lows."""
    consumer = BufferedConsumer({BASE[0]: [f"low{i}" for i in range(50)], CRITICAL: ["crit"]})
    batches = await poll_lanes_first(consumer, [[CRITICAL], [HIGH]], [64, 32], 10, 500)
    assert batches[CRITICAL] == ["crit"]
    assert batches[BASE[0]] == [f"low{i}" for i in range(10)]
    assert consumer.waits_ms == [0, 0, 0]  # two lanes, then the rest without waiting


async def test_without_lane_records_the_poll_waits_as_before() -> None:
    consumer = BufferedConsumer({BASE[1]: ["low"]})
    assert await poll_lanes_first(consumer, [[CRITICAL], []], [64, 32], 10, 500) == {
        BASE[1]: ["low"]
    }
    assert consumer.waits_ms == [0, 500]


@settings(max_examples=50, deadline=None)
@given(
    order=st.permutations([BASE[0], BASE[1], CRITICAL, HIGH]),
    sizes=st.lists(st.integers(0, 20), min_size=4, max_size=4),
    room=st.integers(1, 30),
)
async def test_urgent_records_never_wait_behind_base_ones(order, sizes, room) -> None:
    """Whatever the fetch order: every buffered critical and high record (up to the lanes'
    rooms) comes out in this poll, in partition order, and nothing is lost or doubled."""
    buffered = {tp: [f"{tp.topic}-{tp.partition}-{i}" for i in range(n)]
                for tp, n in zip(order, sizes, strict=True) if n}  # fmt: skip
    consumer = BufferedConsumer(buffered)
    batches = await poll_lanes_first(consumer, [[CRITICAL], [HIGH]], [64, 64], room, 500)
    for lane in (CRITICAL, HIGH):
        assert batches.get(lane, []) == buffered.get(lane, [])
    for tp, records in batches.items():
        assert records == buffered[tp][: len(records)]
    left = sum(len(r) for r in consumer.buffered.values())
    assert left + sum(len(r) for r in batches.values()) == sum(sizes)
