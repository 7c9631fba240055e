"""The commands around the worker: `demo` (what `make run` runs, here on the tiny model),
`broker`, `fetch-model`, and the readiness signal."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient

from worker.cli.demo import QUESTIONS, run_demo
from worker.service.settings import WorkerSettings

REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.kafka
async def test_demo_streams_three_labelled_answers_and_exits_cleanly(tiny_model_dir, capsys) -> None:
    settings = WorkerSettings(model=str(tiny_model_dir), engine={"kv_cache_memory_bytes": 32 << 20})
    assert await run_demo(settings, max_tokens=8) == 0
    out = capsys.readouterr().out
    for urgency, question in QUESTIONS:
        assert f"[{urgency}] {question}" in out
        assert f"({urgency}: " in out
    assert "failed" not in out and "done in" in out


@pytest.mark.kafka
def test_broker_command_prints_its_address_and_stops_on_ctrl_c() -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "worker.cli", "broker"],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        address = process.stdout.readline().strip()
        assert address.startswith("127.0.0.1:")

        async def list_topics() -> list[str]:
            admin = AIOKafkaAdminClient(bootstrap_servers=address, request_timeout_ms=30_000)
            await admin.start()
            try:
                return await admin.list_topics()
            finally:
                await admin.close()

        assert asyncio.run(list_topics()) == []  # a Kafka-speaking, empty broker
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=20) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_fetch_model_prints_the_resolved_directory(tiny_model_dir) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "worker.cli", "fetch-model", "--model", str(tiny_model_dir)],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(tiny_model_dir.resolve())
    missing = subprocess.run(
        [sys.executable, "-m", "worker.cli", "fetch-model", "--model", "/no/such/model"],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 1 and "does not exist" in missing.stderr and missing.stdout == ""


