"""`bench e2e` reads the worker's fused steps by thread count, and its engine thread's waits
for the GIL, from its /metrics."""

from __future__ import annotations

import http.server
import sys
import threading
import time

import pytest

from loadtest.bench_e2e import worker_counters

METRICS = """# HELP mini_infer_engine_fused_steps_total fused decode steps
# TYPE mini_infer_engine_fused_steps_total counter
mini_infer_engine_fused_steps_total{model="m",threads="all"} 253.0
mini_infer_engine_fused_steps_total{model="m",threads="one"} 2.0
mini_infer_engine_fused_steps_created{model="m",threads="one"} 1.7e+09
mini_infer_engine_step_seconds_count{model="m"} 255.0
# TYPE mini_infer_engine_gil_wait_seconds_total counter
mini_infer_engine_gil_wait_seconds_total{model="m"} 0.125
"""


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (the http.server name)
        body = METRICS.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def test_fused_steps_are_read_by_thread_count_and_other_series_ignored():
    server = http.server.HTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.handle_request, daemon=True)  # one request
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        assert worker_counters(url) == ({"all": 253.0, "one": 2.0}, 0.125)
    finally:
        thread.join(timeout=10)
        server.server_close()
    assert worker_counters(None) == ({}, 0.0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/task")
def test_wake_ups_are_counted_per_thread_name_and_grouped_by_side() -> None:
    """A thread that sleeps 20 times shows at least 20 wake-ups under its own name; the sides
    put the engine's threads apart from the worker's others."""
    import os
    import time

    from loadtest.bench_e2e import by_side, wakeups_by_thread
    from worker.service.bridge import set_os_thread_name

    named, started, done, finish = (threading.Event() for _ in range(4))

    def sleeper() -> None:
        set_os_thread_name("sleeper-x")
        named.set()
        started.wait()
        for _ in range(20):
            time.sleep(0.001)
        done.set()
        finish.wait(10)  # alive while it is read

    thread = threading.Thread(target=sleeper, daemon=True)
    thread.start()
    try:
        assert named.wait(10)
        before = wakeups_by_thread(os.getpid())
        started.set()
        assert done.wait(10)
        after = wakeups_by_thread(os.getpid())
    finally:
        finish.set()
        thread.join(10)
    assert after["sleeper-x"] - before.get("sleeper-x", 0) >= 20

    sides = by_side(
        {"worker": {"engine": 3.0, "python": 1.5, "tokenizer": 0.5},
         "broker": {"tokio-rt-worker": 2.0}, "client": {"python": 0.25}}
    )  # fmt: skip
    assert sides == {"engine": 3.0, "worker": 2.0, "broker": 2.0, "client": 0.25}


def _spin_thread(name: str, cpu_s: float, ready: threading.Event, go: threading.Event,
                 done: threading.Event, finish: threading.Event) -> threading.Thread:  # fmt: skip
    """A thread named `name` that, once `go` is set, runs until its own CPU clock has moved
    `cpu_s`, then stays alive (so that it can be read) until `finish`."""
    from worker.service.bridge import set_os_thread_name

    def body() -> None:
        set_os_thread_name(name)
        ready.set()
        go.wait(10)
        start = time.thread_time()
        while time.thread_time() - start < cpu_s:
            pass
        done.set()
        finish.wait(10)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread


def _wait_until_asleep(tid: int) -> None:
    """Until thread `tid` of this process sleeps: a running thread's schedstat clock is
    brought up to date only at the scheduler's next tick or switch, a sleeping one's is."""
    from pathlib import Path

    stat = Path(f"/proc/self/task/{tid}/stat")
    deadline = time.monotonic() + 10
    while stat.read_text().rsplit(")", 1)[1].split()[0] not in ("S", "D"):
        assert time.monotonic() < deadline, "the thread never went to sleep"
        time.sleep(0.001)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/task")
def test_cpu_time_is_read_finer_than_the_kernels_ticks() -> None:
    """A thread that uses 3 ms of CPU (by its own clock) shows 3 ms, where /proc's 10 ms ticks
    would show 0 or 10."""
    import os

    from loadtest import bench_e2e

    if bench_e2e._clocks_by_thread(os.getpid(), 0) is None:
        pytest.skip("this kernel keeps no schedstat: the tick fallback is tested below")
    ready, go, done, finish = (threading.Event() for _ in range(4))
    thread = _spin_thread("spinner-x", 0.003, ready, go, done, finish)
    try:
        assert ready.wait(10)
        _wait_until_asleep(thread.native_id)  # in go.wait
        before = bench_e2e.cpu_seconds_by_thread(os.getpid())
        waits = bench_e2e.run_wait_seconds_by_thread(os.getpid())
        go.set()
        assert done.wait(10)
        _wait_until_asleep(thread.native_id)  # in finish.wait
        after = bench_e2e.cpu_seconds_by_thread(os.getpid())
    finally:
        finish.set()
        thread.join(10)
    used = after["spinner-x"] - before.get("spinner-x", 0.0)
    assert 0.003 <= used < 0.009  # ticks would read 0 or 0.01
    assert all(seconds >= 0.0 for seconds in waits.values())


def test_without_schedstat_the_ticks_are_read(monkeypatch) -> None:
    import os

    from loadtest import bench_e2e

    monkeypatch.setattr(bench_e2e, "_clocks_by_thread", lambda pid, field: None)
    by_name = bench_e2e.cpu_seconds_by_thread(os.getpid())
    assert by_name and all(seconds >= 0.0 for seconds in by_name.values())
    assert bench_e2e.run_wait_seconds_by_thread(os.getpid()) == {}


def test_cpu_bounds_take_the_cpu_beside_from_the_engines_cores() -> None:
    """500 us a token beside an engine on 2 cores at 400 tokens/s (2.5 ms a token): each token
    costs 250 us of each core, a tenth of a token's time."""
    from loadtest.bench_e2e import cpu_bounds

    assert cpu_bounds(500.0, 2, 400.0, 2.5) == {
        "cpu_bound_throughput_ratio": 0.909,  # 1 / 1.1
        "cpu_bound_itl_ratio": 1.1,
    }
    assert cpu_bounds(500.0, 1, 400.0, None) == {"cpu_bound_throughput_ratio": 0.833}  # 1 / 1.2
    assert cpu_bounds(0.0, 2, 400.0, 2.5) == {
        "cpu_bound_throughput_ratio": 1.0, "cpu_bound_itl_ratio": 1.0,
    }  # fmt: skip
