"""The service a load test drives: an external Kafka (the worker's own Kafka settings, so the
same ConfigMap and Secret configure both), or an embedded broker with one `mini-infer serve`
worker started for the run."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from loadtest.workloads import ENGINE_OPTIONS

READY_TIMEOUT_S = 600.0


def kafka_settings(args: argparse.Namespace, bootstrap_servers: str):
    """The worker's own Kafka settings (MINI_INFER_KAFKA__* from the environment, so the same
    ConfigMap and Secret configure both), with this command's flags on top."""
    from worker.client.security import security_flags_given
    from worker.service.settings import WorkerSettings

    overrides: dict = {"bootstrap_servers": bootstrap_servers, **security_flags_given(args)}
    for name in ("request_topic", "control_topic"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    return WorkerSettings(kafka=overrides).kafka


def make_client(kafka):
    from worker.client import ClientOptions, MiniInferClient

    options = ClientOptions(
        request_topic=kafka.request_topic,
        urgency_lanes=kafka.urgency_lanes,  # send by lane exactly when the workers read lanes
        control_topic=kafka.control_topic,
        reply_prefix=kafka.reply_topic_prefix,
        reply_topic=kafka.shared_reply_topic_name,
        # Off unless MINI_INFER_KAFKA__ENABLE_IDEMPOTENCE says so: the SDK's default, and the
        # embedded broker cannot do it. A duplicated request is only generated twice.
        enable_idempotence=bool(kafka.enable_idempotence),
        kafka=kafka.client_options(),
    )
    return MiniInferClient(kafka.bootstrap_servers, options)


@contextlib.asynccontextmanager
async def embedded_service(model: str, dtype: str, num_threads: int | None):
    """An embedded broker and one `mini-infer serve` worker, ready; yields the bootstrap."""
    from worker.broker import EmbeddedBroker

    async with EmbeddedBroker() as broker:
        with tempfile.TemporaryDirectory() as tmp:
            ready_file = Path(tmp) / "ready"
            options = {**ENGINE_OPTIONS, "num_threads": num_threads or default_num_threads()}
            env = {f"MINI_INFER_ENGINE__{k.upper()}": str(v) for k, v in options.items()}
            env["MINI_INFER_KAFKA__ENABLE_IDEMPOTENCE"] = "false"  # the embedded broker lacks it
            command = [sys.executable, "-m", "worker.cli", "serve",
                       "--bootstrap-servers", broker.bootstrap_servers, "--model", model,
                       "--dtype", dtype, "--log-level", "warning",
                       "--ready-file", str(ready_file)]  # fmt: skip
            worker = subprocess.Popen(command, env={**os.environ, **env})
            try:
                await wait_ready(worker, ready_file)
                yield broker.bootstrap_servers
            finally:
                worker.send_signal(signal.SIGTERM)
                await asyncio.to_thread(worker.wait, 60)


def default_num_threads() -> int:
    """A core left to the broker, the client and the worker's event loop. Torch's threads spin
    while they wait for work, so with one per core they fight the Kafka side for the CPU. On
    the 2-core development machine (rate 4, 12 prompts, 64 in / 16 out, other jobs running;
    2 alternating rounds): 2 engine threads took 58.6 and 47.1 s, 1 thread 14.8 and 7.3 s,
    a ratio of medians of 4.8x."""
    return max(1, (os.cpu_count() or 2) - 1)


async def create_bench_topics(bootstrap_servers: str, topics: dict[str, int]) -> None:
    """Create `{name: num_partitions}` (replication 1; one that exists counts as created) on a
    bench's broker, through an admin client opened and closed for it."""
    from aiokafka.admin import AIOKafkaAdminClient

    from worker.topics import create_topics

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers)
    await admin.start()
    try:
        await create_topics(admin, topics, 1)
    finally:
        await admin.close()


def scrape_metrics(
    url: str, timeout_s: float = 10
) -> dict[str, list[tuple[dict[str, str], float]]]:
    """A worker's /metrics at `url`: each sample's (labels, value) by sample name, parsed by
    prometheus_client's text parser. Raises OSError where the worker does not answer."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        text = response.read().decode()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


async def wait_ready(worker: subprocess.Popen, ready_file: Path) -> None:
    """Until the worker wrote its ready file (its topics created, the shared reply topic among
    them, and its model loaded); fails if it exits first or takes READY_TIMEOUT_S."""
    deadline_s = time.monotonic() + READY_TIMEOUT_S
    while not ready_file.exists():
        if worker.poll() is not None:
            raise RuntimeError(f"the worker exited with code {worker.returncode} at start-up")
        if time.monotonic() > deadline_s:
            raise TimeoutError(f"the worker was not ready within {READY_TIMEOUT_S:.0f} s")
        await asyncio.sleep(0.2)
