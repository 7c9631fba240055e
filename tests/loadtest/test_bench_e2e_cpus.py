"""`bench e2e --worker-cpus`: the CPU list, the harness's share, and pinning a process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loadtest.bench_e2e import beside_engine_us_per_token, parse_cpus, pin, split_cpus


def test_cpu_lists_read_as_taskset_writes_them() -> None:
    assert parse_cpus("0") == {0}
    assert parse_cpus("0,1") == {0, 1}
    assert parse_cpus("0-3,8") == {0, 1, 2, 3, 8}
    assert parse_cpus(" 2-2 , 5") == {2, 5}


@pytest.mark.parametrize("text", ["", "a", "1-", "-1", "0,,1", "1-x", "0;1"])
def test_a_malformed_cpu_list_is_a_clear_error(text: str) -> None:
    with pytest.raises(ValueError, match="not a CPU list"):
        parse_cpus(text)


@given(st.sets(st.integers(0, 63), min_size=1), st.sets(st.integers(0, 63), min_size=1))
def test_the_harness_gets_what_the_worker_leaves(worker: set[int], extra: set[int]) -> None:
    available = worker | extra
    if available == worker:
        with pytest.raises(ValueError, match="no CPU for the broker"):
            split_cpus(worker, available)
        return
    harness = split_cpus(worker, available)
    assert harness == available - worker and harness and not harness & worker


def test_worker_cpus_outside_the_machine_are_refused() -> None:
    with pytest.raises(ValueError, match="not all in"):
        split_cpus({0, 99}, {0, 1})


def test_pin_moves_every_thread_of_a_process() -> None:
    available = os.sched_getaffinity(0)
    one = {min(available)}
    # A child with a second thread started before it is pinned.
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import threading, sys; e = threading.Event(); "
         "threading.Thread(target=e.wait, daemon=True).start(); print('up', flush=True); "
         "sys.stdin.readline()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert child.stdout.readline().strip() == "up"
        tasks = os.listdir(f"/proc/{child.pid}/task")
        assert len(tasks) == 2
        pin(child.pid, one)
        assert all(os.sched_getaffinity(int(t)) == one for t in tasks)
    finally:
        child.communicate("\n", timeout=10)


def test_cpu_beside_the_engine_is_every_thread_but_the_engines_per_token() -> None:
    cpu = {
        "worker": {"engine": 0.92, "python": 0.03, "ThreadPoolExecutor-0_0": 0.01},
        "broker": {"tokio-rt-worker": 0.02, "tansu": 0.005},
        "client": {"python": 0.02},
    }
    assert beside_engine_us_per_token(cpu, 100) == {
        "worker": 400.0, "broker": 250.0, "client": 200.0, "total": 850.0,
    }  # fmt: skip
    assert beside_engine_us_per_token({}, 0)["total"] == 0.0  # no run, no division by zero
