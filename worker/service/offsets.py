"""Which offsets may be committed: per partition, everything below the lowest unfinished offset.

Requests finish out of order (a short answer overtakes a long one), but a Kafka commit is a
single number per partition meaning "everything below this is done". Committing the highest
finished offset would lose the slower requests below it if the worker died; so each partition
commits up to its watermark, the lowest offset still in flight. "Finished" means the request's
`final` was acknowledged by the broker, never merely produced.

Pure Python over integers and hashable partition keys: no aiokafka, so it is tested exactly.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable


class PartitionOffsets:
    """Unfinished offsets of one partition and the highest offset seen.

    A heap gives the lowest unfinished offset; finished offsets are removed from the set at once
    and from the heap lazily, when they reach its top.
    """

    def __init__(self) -> None:
        self._unfinished: set[int] = set()
        self._heap: list[int] = []
        self._next_offset: int | None = None  # one past the highest offset seen

    def add(self, offset: int) -> None:
        if offset not in self._unfinished:
            self._unfinished.add(offset)
            heapq.heappush(self._heap, offset)
        if self._next_offset is None or offset + 1 > self._next_offset:
            self._next_offset = offset + 1

    def finish(self, offset: int) -> bool:
        """Mark `offset` done; False when it was not in flight (already finished, or dropped)."""
        if offset not in self._unfinished:
            return False
        self._unfinished.remove(offset)
        return True

    @property
    def num_unfinished(self) -> int:
        return len(self._unfinished)

    @property
    def unfinished_offsets(self) -> list[int]:
        return sorted(self._unfinished)

    @property
    def next_offset(self) -> int | None:
        return self._next_offset

    def watermark(self) -> int | None:
        """The offset to commit: the lowest unfinished one, or one past the highest seen when
        everything is done; None before anything was seen."""
        while self._heap and self._heap[0] not in self._unfinished:
            heapq.heappop(self._heap)
        if self._heap:
            return self._heap[0]
        return self._next_offset


class OffsetTracker:
    """Watermarks of all assigned partitions, and what was last committed for each."""

    def __init__(self) -> None:
        self._partitions: dict[Hashable, PartitionOffsets] = {}
        self._committed: dict[Hashable, int] = {}

    def add(self, partition: Hashable, offset: int) -> None:
        self._partitions.setdefault(partition, PartitionOffsets()).add(offset)

    def finish(self, partition: Hashable, offset: int) -> bool:
        """False for a partition that was revoked meanwhile: its offsets are no longer ours."""
        offsets = self._partitions.get(partition)
        return offsets is not None and offsets.finish(offset)

    @property
    def num_unfinished(self) -> int:
        return sum(p.num_unfinished for p in self._partitions.values())

    def next_offset(self, partition: Hashable) -> int | None:
        """One past the highest offset seen on `partition` (None before its first record)."""
        offsets = self._partitions.get(partition)
        return offsets.next_offset if offsets is not None else None

    def unfinished(self, partition: Hashable) -> list[int]:
        offsets = self._partitions.get(partition)
        return offsets.unfinished_offsets if offsets is not None else []

    def to_commit(self, partitions: Iterable[Hashable] | None = None) -> dict[Hashable, int]:
        """Watermarks that moved past the last commit (of `partitions`, or of all)."""
        keys = self._partitions.keys() if partitions is None else partitions
        result = {}
        for key in keys:
            offsets = self._partitions.get(key)
            mark = offsets.watermark() if offsets is not None else None
            if mark is not None and mark > self._committed.get(key, -1):
                result[key] = mark
        return result

    def mark_committed(self, offsets: dict[Hashable, int]) -> None:
        for key, offset in offsets.items():
            if offset > self._committed.get(key, -1):
                self._committed[key] = offset

    def drop(self, partitions: Iterable[Hashable]) -> None:
        """Forget revoked partitions: their unfinished work belongs to the next owner."""
        for key in partitions:
            self._partitions.pop(key, None)
            self._committed.pop(key, None)
