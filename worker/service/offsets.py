"""Which offsets may be committed: per partition, everything below the lowest unfinished offset.

Requests finish out of order (a short answer overtakes a long one), but a Kafka commit is a
single number per partition meaning "everything below this is done". Committing the highest
finished offset would lose the slower requests below it if the worker died; so each partition
commits up to its watermark, the lowest offset still in flight. "Finished" means the request's
`final` was acknowledged by the broker, never merely produced.

Each assignment of a partition is an epoch (its `PartitionOffsets` object): jobs are stamped
with the epoch their record was consumed in, and an ack carrying another epoch is stale and
ignored. Two ways an ack goes stale: the partition was revoked meanwhile (the record's offset now
belongs to the next owner, and a record handled after the revocation must not re-create state),
or the broker lost its log (the embedded broker keeps everything in memory) and offsets restarted
below what this epoch had seen: a late ack for an old job at offset N must not finish the new,
different request at offset N. Offsets only move forward within one assignment, so an offset
below the highest seen starts a new epoch.

aiokafka rebalances eagerly: every member gives up every partition at each rebalance and gets
its share back at the end of it. So a revoked partition is first `suspend`ed (its epoch and
unfinished offsets kept aside, acks still counted), and at the next assignment either `resume`d
(it came back to us and nobody else moved it meanwhile: its jobs run on, as if nothing happened)
or `forget_suspended` (it moved: its unfinished work is the next owner's).

Pure Python over integers and hashable partition keys: no aiokafka, so it is tested exactly.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Iterable


class PartitionOffsets:
    """Unfinished offsets of one partition and the highest offset seen.

    A heap gives the lowest unfinished offset; finished offsets are removed from the set at once
    and from the heap lazily, when they reach its top.
    """

    def __init__(self) -> None:
        self._unfinished: set[int] = set()
        self._heap: list[int] = []
        self._next_offset: int | None = None  # one past the highest offset seen

    @property
    def next_offset(self) -> int | None:
        return self._next_offset

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
        # Called when a finish leaves nothing in flight (the worker just went idle).
        self.on_idle: Callable[[], None] | None = None
        # Revoked at the start of a rebalance, not yet known to come back: (epoch, committed).
        self._suspended: dict[Hashable, tuple[PartitionOffsets, int | None]] = {}

    def assign(self, partitions: Iterable[Hashable]) -> None:
        """Partitions the group gave us: each starts an epoch (kept if it is still ours)."""
        for key in partitions:
            self._partitions.setdefault(key, PartitionOffsets())

    def is_assigned(self, partition: Hashable) -> bool:
        return partition in self._partitions

    def is_current(self, partition: Hashable, epoch: PartitionOffsets | None) -> bool:
        """Whether `epoch` is the partition's epoch: assigned, or suspended by a rebalance that
        may give it back (work of a suspended epoch goes on until that is known)."""
        if epoch is None:
            return False
        suspended = self._suspended.get(partition)
        return self._partitions.get(partition) is epoch or (
            suspended is not None and suspended[0] is epoch
        )

    def add(self, partition: Hashable, offset: int) -> PartitionOffsets | None:
        """Track a consumed offset; returns the epoch to stamp its job with, or None when the
        partition is not (or no longer) assigned: the record is not ours to handle."""
        offsets = self._partitions.get(partition)
        if offsets is None:
            return None
        if offsets.next_offset is not None and offset < offsets.next_offset:
            # The log went backwards (the broker lost its data): a new epoch, and the committed
            # offset the broker forgot no longer bounds what may be committed.
            offsets = self._partitions[partition] = PartitionOffsets()
            self._committed.pop(partition, None)
        offsets.add(offset)
        return offsets

    def finish(self, partition: Hashable, offset: int, epoch: PartitionOffsets | None) -> bool:
        """False for a stale ack (another epoch: revoked or reset meanwhile) or an offset that
        is not in flight."""
        if not (self.is_current(partition, epoch) and epoch.finish(offset)):
            return False
        if self.on_idle is not None and epoch.num_unfinished == 0 and self.num_unfinished == 0:
            self.on_idle()
        return True

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
            self._suspended.pop(key, None)

    def suspend(self, partitions: Iterable[Hashable]) -> None:
        """Revoked by an (eager) rebalance that may give them back: set their epochs aside.
        Acks of their jobs still count meanwhile; nothing of them is committed until resumed."""
        for key in partitions:
            offsets = self._partitions.pop(key, None)
            if offsets is not None:
                self._suspended[key] = (offsets, self._committed.pop(key, None))

    @property
    def suspended(self) -> set[Hashable]:
        return set(self._suspended)

    def committed_when_suspended(self, partition: Hashable) -> int | None:
        """What this worker had committed for a suspended partition (None: nothing)."""
        return self._suspended[partition][1]

    def resume(self, partition: Hashable) -> int | None:
        """A suspended partition came back unchanged: its epoch goes on. Returns the offset to
        fetch from next (one past the highest seen; None if none was seen)."""
        offsets, committed = self._suspended.pop(partition)
        self._partitions[partition] = offsets
        if committed is not None:
            self._committed[partition] = committed
        return offsets.next_offset

    def forget_suspended(self) -> set[Hashable]:
        """The suspended partitions that did not come back: forgotten; returns them."""
        gone = set(self._suspended)
        self._suspended.clear()
        return gone
