"""Offset gaps in a partition read live: fetched again before they are believed.

Within a partition, a reader expects each record at one past the previous one. Apache Kafka
leaves real gaps there (a transaction's commit marker, records removed by compaction), and a
refetch shows the same gap again. The embedded broker can also leave a false one: a fetch that
races a concurrent write from another connection to the same partition can return a later
batch while an earlier one is still being stored, and aiokafka's position then moves past the
earlier batch for good. (Measured: three producers writing 60,000 records to one partition
while a consumer read it live; the live reader missed 1-6 records in half of the runs, and a
reader started afterwards found every one.) Found as a reply stream missing two token messages
in the rebalance test.

So a reader that meets a gap seeks back to the offset it expected, drops the rest of that
partition's fetched records, and fetches again, at most `max_refetches` times for the same
gap; a gap still there after that is real and is accepted (logged). On Apache Kafka this costs
a refetch per transaction marker and nothing otherwise.

Every reader of records that must not be missed uses it: the worker's request and control
consumers, the client's reply router, and `TopicReader`. Where the reader knows its position
before the first record (`expect`: an assignment's committed offset, the start of a topic),
the first record is checked too. Pure: no aiokafka, no clock.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import Any

import structlog

log = structlog.get_logger(__name__)

DEFAULT_MAX_REFETCHES = 3


class OffsetGaps:
    """Per partition: the offset expected next, and how often the current gap was refetched."""

    def __init__(self, max_refetches: int = DEFAULT_MAX_REFETCHES, what: str = "records"):
        self.max_refetches = max_refetches
        self.what = what  # for the log: whose records these are
        self._next: dict[Hashable, int] = {}
        self._gap: dict[Hashable, tuple[int, int]] = {}  # partition -> (expected, refetches)
        self.num_refetches = 0
        self.num_accepted = 0  # gaps still there after `max_refetches` refetches

    def check(self, partition: Hashable, offset: int) -> int | None:
        """The record at `offset` was fetched. None: take it. Otherwise the offset to seek
        `partition` back to, dropping this record and the rest of the partition's fetch."""
        return self.check_expected(partition, offset, self._next.get(partition))

    def check_expected(self, partition: Hashable, offset: int, expected: int | None) -> int | None:
        """`check`, against the offset the caller expects (None: nothing yet, take any)."""
        if expected is not None and offset > expected:
            gap = self._gap.get(partition)
            num_refetches = gap[1] if gap is not None and gap[0] == expected else 0
            if num_refetches < self.max_refetches:
                self._gap[partition] = (expected, num_refetches + 1)
                self.num_refetches += 1
                log.info(
                    "offsets.gap_refetched", what=self.what, partition=str(partition),
                    expected=expected, fetched=offset, num_refetches=num_refetches + 1,
                )  # fmt: skip
                return expected
            self.num_accepted += 1
            log.warning(
                "offsets.gap_accepted", what=self.what, partition=str(partition),
                expected=expected, fetched=offset, num_refetches=num_refetches,
            )  # fmt: skip
        if self._gap:
            self._gap.pop(partition, None)
        self._next[partition] = offset + 1
        return None

    def expect(self, partition: Hashable, offset: int) -> None:
        """The reader's position on `partition` before its first record (after an assignment
        or a seek): the first record is checked against it too. Not for a position the broker
        may report wrong (the embedded broker's log end after batched writes)."""
        self._next[partition] = offset
        self._gap.pop(partition, None)

    def expected(self, partition: Hashable) -> int | None:
        return self._next.get(partition)

    def forget(self, partition: Hashable) -> None:
        """The reader moved `partition` itself (a seek, an assignment): expect nothing."""
        self._next.pop(partition, None)
        self._gap.pop(partition, None)


def records_of(consumer: Any, gaps: OffsetGaps, batches: Mapping[Any, Sequence[Any]]) -> Iterator:
    """The records of one `getmany`, partition by partition, with gaps fetched again: where a
    partition shows one, `consumer` is sought back and the partition's other records are not
    handed on (they come again)."""
    for partition, records in batches.items():
        for record in records:
            back = gaps.check(partition, record.offset)
            if back is not None:
                consumer.seek(partition, back)
                break
            yield record
