"""--model (hub ids), --revision and --served-model-name: flags and env reach the engine
factory and the routing names."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from tests.hub_cache import add_to_hub_cache, commit_hash
from worker.cli.serve import add_arguments
from worker.service.settings import WorkerSettings, settings_from_args
from worker.service.worker import default_engine_factory, served_model_names

REPO_ROOT = Path(__file__).resolve().parents[3]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_flags_and_env_set_model_revision_and_served_name(monkeypatch) -> None:
    s = settings_from_args(
        parse("--model", "Qwen/Qwen3-0.6B", "--revision", "v1", "--served-model-name", "qwen")
    )
    assert (s.model, s.revision, s.served_model_name, s.model_name) == (
        "Qwen/Qwen3-0.6B", "v1", "qwen", "qwen",
    )  # fmt: skip
    assert WorkerSettings(model="org/name").model_name == "org/name"  # defaults to --model
    monkeypatch.setenv("MINI_INFER_SERVED_MODEL_NAME", "from-env")
    monkeypatch.setenv("MINI_INFER_REVISION", "abc")
    s = settings_from_args(parse("--model", "org/name"))
    assert (s.revision, s.model_name) == ("abc", "from-env")


@pytest.mark.parametrize("field", ["revision", "served_model_name"])
def test_empty_names_are_refused(field) -> None:
    with pytest.raises(ValidationError, match=field):
        WorkerSettings(**{field: ""})


def test_a_served_name_replaces_the_path_derived_names() -> None:
    derived = served_model_names("org/name", "/cache/models--org--name/snapshots/abc")
    assert "org/name" in derived
    assert served_model_names("org/name", "/cache/x/abc", "prod-chat") == {"prod-chat"}


def test_the_engine_factory_loads_a_hub_id_at_its_revision(
    tmp_path, monkeypatch, tiny_model_dir
) -> None:
    add_to_hub_cache(tmp_path, "org/tiny", tiny_model_dir, refs=("v3",))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    settings = WorkerSettings(
        model="org/tiny", revision="v3", engine={"kv_cache_memory_bytes": 8 << 20}
    )
    engine = default_engine_factory(settings)()
    assert engine.model_path.name == commit_hash("org/tiny")
    missing = WorkerSettings(model="org/tiny", revision="v4")
    with pytest.raises(ValueError, match="org/tiny@v4"):
        default_engine_factory(missing)()


def test_fetch_model_cli_resolves_a_hub_id_offline(tmp_path, tiny_model_dir) -> None:
    """The environment as a user sets it before starting a process: HF_HUB_CACHE and
    HF_HUB_OFFLINE read by huggingface_hub itself, no network."""
    snapshot = add_to_hub_cache(tmp_path, "org/tiny", tiny_model_dir, refs=("v1",))
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HUB_CACHE": str(tmp_path),
           "HF_HUB_OFFLINE": "1"}  # fmt: skip
    command = [sys.executable, "-m", "worker.cli", "fetch-model", "--model", "org/tiny"]
    found = subprocess.run(
        [*command, "--revision", "v1"], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip() == str(snapshot)
    missing = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                             timeout=120)  # fmt: skip
    assert missing.returncode == 1 and "org/tiny" in missing.stderr and missing.stdout == ""
