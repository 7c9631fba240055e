"""The watermark rule: commit only below the lowest unfinished offset, never past it."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from worker.service.offsets import OffsetTracker, PartitionOffsets


def test_watermark_waits_for_the_lowest_unfinished_offset() -> None:
    p = PartitionOffsets()
    assert p.watermark() is None
    for offset in (10, 11, 12):
        p.add(offset)
    assert p.watermark() == 10
    assert p.finish(12) and p.finish(11)
    assert p.watermark() == 10  # 11 and 12 are done, but 10 is not: nothing may be committed
    assert p.finish(10)
    assert p.watermark() == 13
    assert not p.finish(10)  # twice is a no-op


@given(
    num_offsets=st.integers(1, 60),
    first=st.integers(0, 1000),
    data=st.data(),
)
def test_watermark_never_passes_an_unfinished_offset(num_offsets: int, first: int, data) -> None:
    offsets = list(range(first, first + num_offsets))
    order = data.draw(st.permutations(offsets))
    num_finished = data.draw(st.integers(0, num_offsets))
    p = PartitionOffsets()
    for offset in offsets:
        p.add(offset)
    finished = set()
    for offset in order[:num_finished]:
        p.finish(offset)
        finished.add(offset)
        mark = p.watermark()
        unfinished = [o for o in offsets if o not in finished]
        # Everything below the mark is finished, and the mark is the first unfinished offset.
        assert all(o in finished for o in offsets if o < mark)
        assert mark == (min(unfinished) if unfinished else first + num_offsets)


@given(st.lists(st.tuples(st.sampled_from("ab"), st.integers(0, 30)), max_size=40), st.data())
def test_tracker_commits_only_forward_and_only_finished_prefixes(adds, data) -> None:
    tracker = OffsetTracker()
    added = sorted(set(adds))
    for partition, offset in added:
        tracker.add(partition, offset)
    done = data.draw(st.lists(st.sampled_from(added), unique=True) if added else st.just([]))
    for partition, offset in done:
        assert tracker.finish(partition, offset)
    commits = tracker.to_commit()
    for partition, mark in commits.items():
        mine = [o for p, o in added if p == partition]
        assert all((partition, o) in done for o in mine if o < mark)
    tracker.mark_committed(commits)
    assert tracker.to_commit() == {}  # nothing new finished: nothing to commit again
    assert tracker.num_unfinished == len(added) - len(done)


def test_dropped_partitions_forget_their_offsets() -> None:
    tracker = OffsetTracker()
    tracker.add("a", 5)
    tracker.add("b", 7)
    tracker.drop(["a"])
    assert not tracker.finish("a", 5)  # a late ack from a revoked partition is ignored
    assert tracker.num_unfinished == 1
    assert tracker.to_commit() == {"b": 7}
    tracker.add("a", 9)  # reassigned later: starts afresh
    assert tracker.to_commit() == {"a": 9, "b": 7}
