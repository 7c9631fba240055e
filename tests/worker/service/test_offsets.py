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
    tracker.assign("ab")
    added = sorted(set(adds))
    epochs = {(partition, offset): tracker.add(partition, offset) for partition, offset in added}
    done = data.draw(st.lists(st.sampled_from(added), unique=True) if added else st.just([]))
    for partition, offset in done:
        assert tracker.finish(partition, offset, epochs[partition, offset])
    commits = tracker.to_commit()
    for partition, mark in commits.items():
        mine = [o for p, o in added if p == partition]
        assert all((partition, o) in done for o in mine if o < mark)
    tracker.mark_committed(commits)
    assert tracker.to_commit() == {}  # nothing new finished: nothing to commit again
    assert tracker.num_unfinished == len(added) - len(done)


def test_dropped_partitions_forget_their_offsets() -> None:
    tracker = OffsetTracker()
    tracker.assign(["a", "b"])
    epoch_a = tracker.add("a", 5)
    tracker.add("b", 7)
    tracker.drop(["a"])
    assert not tracker.finish("a", 5, epoch_a)  # a late ack from a revoked partition is ignored
    assert tracker.num_unfinished == 1
    assert tracker.to_commit() == {"b": 7}
    tracker.assign(["a"])  # reassigned later: starts afresh
    tracker.add("a", 9)
    assert tracker.to_commit() == {"a": 9, "b": 7}


def test_a_record_handled_after_revocation_does_not_recreate_its_partition() -> None:
    """Guards against records of a revoked partition (handled after an await in the poll loop)
    re-creating tracker state: their offsets would count as in flight forever, and a commit
    for a partition we no longer own could follow."""
    tracker = OffsetTracker()
    tracker.assign(["a"])
    epoch = tracker.add("a", 3)
    tracker.drop(["a"])
    assert tracker.add("a", 4) is None
    assert not tracker.is_assigned("a") and not tracker.is_current("a", epoch)
    assert tracker.num_unfinished == 0 and tracker.to_commit() == {}


def test_a_late_ack_after_the_log_restarted_does_not_finish_the_new_request() -> None:
    """Guards against the broker losing its data (offsets restart at 0): the late ack of an old
    job at offset 4 must not mark the new, different request at offset 4 finished, and the
    commit the broker forgot must not hold the new log's commits back."""
    tracker = OffsetTracker()
    tracker.assign(["a"])
    old = {offset: tracker.add("a", offset) for offset in range(5)}
    for offset in range(4):
        assert tracker.finish("a", offset, old[offset])
    tracker.mark_committed(tracker.to_commit())  # committed 4
    new = {offset: tracker.add("a", offset) for offset in range(5)}  # the log went backwards
    assert new[0] is not old[4]
    assert not tracker.finish("a", 4, old[4])  # stale: ignored
    assert tracker.unfinished("a") == [0, 1, 2, 3, 4]
    assert tracker.finish("a", 0, new[0])
    assert tracker.to_commit() == {"a": 1}


def test_a_partition_given_back_by_an_eager_rebalance_keeps_its_epoch() -> None:
    """Guards against every in-flight request being redone at each rebalance: aiokafka revokes
    every partition and gives most of them back; one that comes back keeps its epoch (acks that
    landed meanwhile count), one that moved is forgotten."""
    tracker = OffsetTracker()
    tracker.assign(["a", "b"])
    epoch_a = {offset: tracker.add("a", offset) for offset in range(3)}
    epoch_b = tracker.add("b", 0)
    assert tracker.finish("a", 0, epoch_a[0])
    tracker.mark_committed(tracker.to_commit())  # a: 1, b: 0
    tracker.suspend(["a", "b"])
    assert tracker.add("a", 3) is None  # not ours while suspended: nothing is tracked
    assert tracker.to_commit() == {}  # and nothing committed
    assert tracker.is_current("a", epoch_a[1])
    assert tracker.finish("a", 1, epoch_a[1])  # an ack during the rebalance still counts
    assert tracker.committed_when_suspended("a") == 1
    assert tracker.resume("a") == 3  # fetching goes on after the last record seen
    assert tracker.forget_suspended() == {"b"}
    assert not tracker.is_current("b", epoch_b) and not tracker.finish("b", 0, epoch_b)
    tracker.assign(["a"])  # the assignment does not start a new epoch for a resumed partition
    assert tracker.is_current("a", epoch_a[2]) and tracker.unfinished("a") == [2]
    assert tracker.to_commit() == {"a": 2}


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["add", "finish", "stale"]), st.integers(0, 2), st.integers(0, 5)
        ),
        max_size=60,
    )
)
def test_on_idle_is_called_exactly_when_a_finish_leaves_nothing_in_flight(ops) -> None:
    """The consumer's hook for the idle fetch wait: once per finish that empties the tracker,
    never for a stale ack or one that leaves work in flight."""
    tracker = OffsetTracker()
    tracker.assign([0, 1, 2])
    calls = []
    tracker.on_idle = lambda: calls.append(tracker.num_unfinished)
    epochs = {}
    expected = 0
    for op, partition, offset in ops:
        if op == "add":
            epochs[partition] = tracker.add(partition, offset) or epochs.get(partition)
        elif op == "finish":
            before = tracker.num_unfinished
            if tracker.finish(partition, offset, epochs.get(partition)) and before == 1:
                expected += 1
        else:  # an ack from no epoch of ours
            assert not tracker.finish(partition, offset, PartitionOffsets())
    assert calls == [0] * expected
