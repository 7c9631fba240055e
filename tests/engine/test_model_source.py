"""Hub ids load through huggingface_hub's cache: offline, from a directory laid out as the hub
cache (tests/hub_cache.py), at main, a tag or a commit; every failure is a ValueError that names
the model."""

from __future__ import annotations

import json
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams
from engine.loader import resolve_model
from engine.model_source import is_hub_id
from tests.hub_cache import add_to_hub_cache, commit_hash


@pytest.fixture(scope="module")
def hub_root(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("hub-cache")
    add_to_hub_cache(root, "org/tiny", tiny_model_dir, refs=("main", "v1"))
    add_to_hub_cache(root, "org/tiny", tiny_model_dir, refs=("v2",), commit=commit_hash("v2"))
    unsupported = tmp_path_factory.mktemp("bert")
    (unsupported / "config.json").write_text(
        json.dumps({"architectures": ["BertForMaskedLM"], "model_type": "bert"})
    )
    add_to_hub_cache(root, "org/bert", unsupported)
    return root


@pytest.fixture
def offline_hub(monkeypatch, hub_root):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub_root


def test_hub_id_resolves_to_its_snapshot_at_main_a_tag_or_a_commit(offline_hub):
    snapshots = offline_hub / "models--org--tiny" / "snapshots"
    assert resolve_model("org/tiny") == snapshots / commit_hash("org/tiny")
    assert resolve_model("org/tiny", revision="v1") == snapshots / commit_hash("org/tiny")
    assert resolve_model("org/tiny", revision="v2") == snapshots / commit_hash("v2")
    assert resolve_model("org/tiny", revision=commit_hash("v2")) == snapshots / commit_hash("v2")


def test_llm_by_hub_id_generates_what_the_directory_does(offline_hub, tiny_model_dir):
    params = SamplingParams(max_tokens=6, temperature=0.0)
    by_id = LLM("org/tiny", revision="v2", num_kv_blocks=32)
    assert by_id.model_path.parent.name == "snapshots"
    by_dir = LLM(tiny_model_dir, num_kv_blocks=32)
    prompts = [[5, 9, 13, 40], [7, 7, 100]]
    assert [o.token_ids for o in by_id.generate(prompts, params)] == [
        o.token_ids for o in by_dir.generate(prompts, params)
    ]


@pytest.mark.parametrize(
    ("model", "revision", "message"),
    [
        ("org/missing", None, "not in the hub cache"),
        ("org/tiny", "no-such-tag", "not in the hub cache"),
    ],
)
def test_offline_cache_miss_names_the_model(offline_hub, model, revision, message):
    with pytest.raises(ValueError, match=message) as error:
        resolve_model(model, revision=revision)
    assert model in str(error.value) and "HF_HUB_OFFLINE" in str(error.value)


def test_unsupported_architecture_names_the_supported_ones(offline_hub):
    # Only config.json is cached: the check happens before any weight is fetched.
    with pytest.raises(ValueError, match="BertForMaskedLM") as error:
        resolve_model("org/bert")
    assert "LlamaForCausalLM" in str(error.value) and "Qwen2ForCausalLM" in str(error.value)


def test_revision_of_a_local_directory_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="hub ids only"):
        resolve_model(tiny_model_dir, revision="main")


def test_an_existing_local_path_is_never_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not is_hub_id("org/name")
    assert is_hub_id("org/other")
    assert not is_hub_id("/abs/path") and not is_hub_id("a/b/c") and not is_hub_id("x.gguf")


_NAME_CHARS = string.ascii_letters + string.digits + "._-/ :"


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(model=st.text(alphabet=_NAME_CHARS, min_size=1, max_size=30))
def test_any_unknown_name_is_a_value_error(offline_hub, model):
    # Offline, nothing but org/tiny and org/bert is known: every other name is refused with a
    # ValueError (never a crash from inside huggingface_hub) that quotes it.
    if model in ("org/tiny", "org/bert"):
        return
    with pytest.raises(ValueError) as error:
        resolve_model(model)
    assert repr(model)[1:-1] in str(error.value) or model.strip() in str(error.value)
