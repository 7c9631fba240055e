"""Workers for real-broker tests, started one way and always stopped: `running_worker` (a
`Worker` in this process), `running_workers` (several, in one group, the partitions split
between them) and `serve_process` (`mini-infer serve`, or the gated variant, as a process with
a JSON log)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVE_GRACE_S = 0.5  # `serve --grace-s`: the tests that stop a process want it short


@contextlib.asynccontextmanager
async def running_worker(
    settings, engine_factory=None, *, grace_s: float = 5.0, is_assigned: bool = True, **options
):
    """A `Worker` started (and, if `is_assigned`, holding partitions), stopped on exit by the
    ordered stop, draining for `grace_s`, even when the body failed. A body that stopped or
    aborted the worker itself is left as it is."""
    from worker.service.worker import Worker

    worker = Worker(settings, engine_factory=engine_factory, **options)
    await worker.start()  # a failed start closes what it started
    try:
        if is_assigned:
            await worker.wait_assigned()
        yield worker
    finally:
        if worker.consumer is not None:  # not stopped yet
            await worker.stop(grace_s=grace_s)


def is_split(workers, num_partitions: int) -> bool:
    """Every worker holds partitions, and together they hold all `num_partitions`, each once
    (a settled rebalance)."""
    held = [w.consumer.assignment if w.consumer is not None else set() for w in workers]
    return all(held) and sum(map(len, held)) == num_partitions == len(set().union(*held))


async def wait_for_split(workers, num_partitions: int, timeout_s: float = 60.0) -> None:
    from tests.worker.kafka_helpers import wait_for

    await wait_for(lambda: is_split(workers, num_partitions), timeout_s, "a settled split")


@contextlib.asynccontextmanager
async def running_workers(workers: list, num_partitions: int, *, grace_s: float = 5.0):
    """`workers` (built, not started) started together and holding the `num_partitions`
    partitions between them, every one some; on exit each still running is stopped by the
    ordered stop, draining for `grace_s`, even when the body failed."""
    try:
        await asyncio.gather(*(w.start() for w in workers))
        await wait_for_split(workers, num_partitions)
        yield workers
    finally:
        await asyncio.gather(*(w.stop(grace_s=grace_s) for w in workers if w.consumer is not None))


def start_serve(
    bootstrap_servers: str,
    model_dir: Path,
    group_id: str,
    topic: str,
    ready_file: Path,
    log_path: Path,
    worker_id: str = "terminated",
    num_partitions: int = 2,
    extra_env: dict[str, str] | None = None,
    module: str = "worker.cli",
) -> subprocess.Popen:
    """`python -m <module> serve` on the tiny model; its output goes to `log_path`."""
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO_ROOT),
        "MINI_INFER_ENGINE__KV_CACHE_MEMORY_BYTES": str(32 << 20),
        "MINI_INFER_KAFKA__CONTROL_TOPIC": topic + ".control",
        "MINI_INFER_KAFKA__DLQ_TOPIC": topic + ".dlq",
        # As in the other tests: the embedded broker makes a successor wait for the leaver's
        # session to expire, so a shorter (still Kafka-legal) session keeps the test short.
        "MINI_INFER_KAFKA__SESSION_TIMEOUT_MS": "6000",
        "MINI_INFER_KAFKA__HEARTBEAT_INTERVAL_MS": "1000",
        **(extra_env or {}),
    }
    command = [
        sys.executable, "-m", module, "serve",
        "--bootstrap-servers", bootstrap_servers, "--model", str(model_dir), "--group-id", group_id,
        "--request-topic", topic, "--partitions", str(num_partitions),
        "--grace-s", str(SERVE_GRACE_S), "--ready-file", str(ready_file),
        "--worker-id", worker_id, "--log-format", "json",
    ]  # fmt: skip
    with open(log_path, "wb") as log_file:
        return subprocess.Popen(
            command, cwd=REPO_ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT
        )


async def wait_for_file(
    path: Path, process: subprocess.Popen, log_path: Path, timeout_s: float = 180.0
) -> None:
    """Until `serve` wrote its ready file; kills it and fails with its log if it died first."""
    deadline_s = time.monotonic() + timeout_s
    while not path.exists():
        if process.poll() is not None or time.monotonic() > deadline_s:
            process.kill()
            raise AssertionError(f"serve did not get ready:\n{log_path.read_text()[-3000:]}")
        await asyncio.sleep(0.1)


def kill(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()


@contextlib.asynccontextmanager
async def serve_process(
    bootstrap_servers: str,
    model_dir: Path,
    group_id: str,
    topic: str,
    tmp_path: Path,
    worker_id: str = "terminated",
    *,
    is_ready_awaited: bool = True,
    **options,
):
    """`start_serve` with its ready file and log under `tmp_path` (named by `worker_id`),
    waited for until ready unless told not to; killed on exit if it still runs. Yields the
    process; its log is at `process.log_path`, its ready file at `process.ready_file`."""
    ready_file, log_path = tmp_path / f"{worker_id}.ready", tmp_path / f"{worker_id}.log"
    process = start_serve(
        bootstrap_servers, model_dir, group_id, topic, ready_file, log_path, worker_id, **options
    )
    process.ready_file, process.log_path = ready_file, log_path
    try:
        if is_ready_awaited:
            await wait_for_file(ready_file, process, log_path)
        yield process
    finally:
        kill(process)


def log_events(log_path: Path) -> list[dict]:
    """The JSON events of a `serve` log (other lines skipped)."""
    events = []
    for line in log_path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # the embedded-broker banner or a library's plain print
    return events
