"""The worker lowers its event loop's thread, and only that thread (Linux nice values and
scheduling policies are per thread)."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from worker.service.settings import WorkerSettings
from worker.service.worker import loop_priority, lower_thread_priority

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice is Linux's")


def _in_fresh_thread(niceness: int) -> tuple[int, int, int]:
    """(own nice after the call, nice of a thread it starts after, the caller's nice)."""
    result = {}

    def body():
        tid = threading.get_native_id()
        before = os.getpriority(os.PRIO_PROCESS, tid)
        lower_thread_priority(niceness)
        result["own"] = os.getpriority(os.PRIO_PROCESS, tid) - before
        child = threading.Thread(
            target=lambda: result.update(
                child=os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) - before
            )
        )
        child.start()
        child.join()

    caller_before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    caller = os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) - caller_before
    return result["own"], result["child"], caller


def test_the_calling_thread_is_lowered_and_the_process_is_not():
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    target = min(19, base + 5)
    own, child, caller = _in_fresh_thread(target)
    assert own == target - base  # this thread
    assert child == target - base  # threads it starts later inherit it
    assert caller == 0  # the others keep theirs


def test_zero_leaves_the_thread_alone():
    assert _in_fresh_thread(0) == (0, 0, 0)


def test_the_setting_defaults_to_19_and_is_bounded(monkeypatch):
    monkeypatch.delenv("MINI_INFER_EVENT_LOOP_NICE", raising=False)
    assert WorkerSettings().event_loop_nice == 19
    with pytest.raises(ValueError):
        WorkerSettings(event_loop_nice=20)


def _policies_in_fresh_thread(policy: str) -> tuple[int, int, int]:
    """(own policy after the call, policy of a thread it starts after, the caller's policy)."""
    result = {}

    def body():
        lower_thread_priority(0, policy)
        result["own"] = os.sched_getscheduler(threading.get_native_id())
        child = threading.Thread(
            target=lambda: result.update(child=os.sched_getscheduler(threading.get_native_id()))
        )
        child.start()
        child.join()

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    return result["own"], result["child"], os.sched_getscheduler(threading.get_native_id())


def test_the_idle_policy_puts_the_calling_thread_and_its_later_threads_under_sched_idle():
    """SCHED_IDLE: a waking engine thread takes the core back from the loop at once."""
    caller = os.sched_getscheduler(threading.get_native_id())
    assert caller != os.SCHED_IDLE  # the test runner's own thread (conftest: "normal")
    assert _policies_in_fresh_thread("idle") == (os.SCHED_IDLE, os.SCHED_IDLE, caller)


def test_the_normal_policy_leaves_the_thread_alone():
    caller = os.sched_getscheduler(threading.get_native_id())
    assert _policies_in_fresh_thread("normal") == (caller, caller, caller)


def test_the_policy_defaults_to_idle_and_is_one_of_two(monkeypatch):
    monkeypatch.delenv("MINI_INFER_EVENT_LOOP_POLICY", raising=False)
    assert WorkerSettings().event_loop_policy == "idle"
    monkeypatch.setenv("MINI_INFER_EVENT_LOOP_POLICY", "normal")
    assert WorkerSettings().event_loop_policy == "normal"
    with pytest.raises(ValueError):
        WorkerSettings(event_loop_policy="fifo")


@pytest.mark.parametrize("num_cpus", [2, 3, 64])
def test_with_room_beside_the_engine_the_loop_is_lowered_as_configured(num_cpus: int):
    assert loop_priority(19, "idle", num_cpus) == (19, "idle")
    assert loop_priority(7, "normal", num_cpus) == (7, "normal")


@pytest.mark.parametrize(("niceness", "policy"), [(19, "idle"), (19, "normal"), (0, "idle")])
def test_with_one_cpu_the_loop_keeps_the_engines_priority(niceness: int, policy: str):
    """One CPU: the engine's thread never sleeps while it generates, so a lowered loop would
    stream a request's tokens in one burst at its end."""
    assert loop_priority(niceness, policy, 1) == (0, "normal")
