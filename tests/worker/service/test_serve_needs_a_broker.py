"""`mini-infer serve` never invents a broker: without bootstrap servers it exits at once with a
message naming the setting (before loading a model), and only `--embedded-broker` starts the
in-memory one. Guards against a production pod that reports ready on a broker nobody can reach."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.worker.kafka_helpers import SMALL_ENGINE
from worker.service.settings import WorkerSettings
from worker.service.worker import serve

REPO_ROOT = Path(__file__).resolve().parents[3]


def test_serve_without_bootstrap_servers_exits_with_a_clear_message(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MINI_INFER_")}
    # A model path that does not exist: the broker check must come first, before any load.
    command = [
        sys.executable, "-m", "worker.cli", "serve", "--model", str(tmp_path / "no-such-model"),
        "--log-format", "json",
    ]  # fmt: skip
    result = subprocess.run(
        command, cwd=REPO_ROOT, env={**env, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert "MINI_INFER_KAFKA__BOOTSTRAP_SERVERS" in result.stderr
    assert "--embedded-broker" in result.stderr
    assert "embedded broker on" not in result.stderr
    assert "no-such-model" not in result.stderr  # it never got as far as the model


@pytest.mark.kafka
async def test_embedded_broker_only_when_asked(tiny_model_dir, tmp_path) -> None:
    ready_file = tmp_path / "ready.json"
    settings = WorkerSettings(
        model=str(tiny_model_dir),
        kafka={"embedded_broker": True},
        engine=SMALL_ENGINE,
        observability={"ready_file": ready_file},
    )
    stop = asyncio.Event()
    served = asyncio.create_task(serve(settings, stop))
    try:
        while not ready_file.exists():
            assert not served.done(), "serve --embedded-broker stopped before it was ready"
            await asyncio.sleep(0.05)
    finally:
        stop.set()
    assert await asyncio.wait_for(served, 60) == 0
