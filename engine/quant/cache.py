"""Quantize once, keep the result: the canonical quantized tensors of a (model, scheme) pair
in one safetensors file under the cache directory, with a manifest written last.

The manifest names the scheme, a fingerprint of the source checkpoint (file names, sizes and
mtimes) and the SHA-256 and size of the tensor file. A load checks all of them before trusting
the file: a partial write (no manifest, or a size that disagrees), a corrupted file (the hash
disagrees) or a stale one (the checkpoint changed) is deleted and rebuilt, never used. Writes go
to temporary names and are renamed into place, the manifest last, under a file lock.

Only the quantized layers' tensors are cached; the rest (embeddings, norms) still come from the
checkpoint, memory-mapped and skipping the big projection weights.

Measured (SmolLM2 int4 from the cache, bf16, 2-core AMD EPYC Zen 4 shared with other jobs, the
files in the page cache, cProfile): `load_model_weights` 0.83 s, of which packing for the
kernels 0.44 s (then torch's int4 layout and the C++ GEMV's; now the C++ one's only: 0.17 s), the float checkpoint's other
tensors 0.17 s, the SHA-256 of the 161 MB tensor file 0.13 s, the cached tensors 0.08 s. A
cold start adds the disk reads; importing the two built C++ kernels is separate (~2 s of CPU).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import structlog
from torch import nn

from engine.quant.config import QuantConfig
from engine.quant.linear import QuantLinear

log = structlog.get_logger(__name__)

CACHE_FORMAT = 3  # 2: lm_head is int8 for every scheme; 3: int4 scales/minimums fp16 values


def quant_modules(model: nn.Module) -> dict[str, QuantLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}


def cache_paths(root: Path, model_path: Path, quant: QuantConfig) -> tuple[Path, Path]:
    """(tensor file, manifest) for this model and scheme under `root`."""
    key = hashlib.sha256(str(Path(model_path).resolve()).encode()).hexdigest()[:12]
    folder = Path(root) / f"{Path(model_path).name}-{key}"
    return folder / f"{quant.name}.safetensors", folder / f"{quant.name}.manifest.json"


def source_fingerprint(model_path: Path) -> list[list]:
    files = sorted(Path(model_path).glob("*.safetensors")) + sorted(Path(model_path).glob("*.gguf"))
    return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def save_quantized(
    model: nn.Module, tensor_path: Path, manifest_path: Path, quant: QuantConfig, source: list
) -> None:
    """Write every quantized layer's canonical tensors, then the manifest (the commit point)."""
    state = {
        f"{name}.{key}": tensor.contiguous()
        for name, module in quant_modules(model).items()
        for key, tensor in module.quantized_state().items()
    }
    tensor_path.parent.mkdir(parents=True, exist_ok=True)
    tmp_tensors = tensor_path.with_name(f".{tensor_path.name}.tmp-{os.getpid()}")
    tmp_manifest = manifest_path.with_name(f".{manifest_path.name}.tmp-{os.getpid()}")
    manifest_path.unlink(missing_ok=True)  # the old manifest must not vouch for new bytes
    from safetensors.torch import save_file  # imported when used: a GGUF load never does

    save_file(state, str(tmp_tensors), metadata={"scheme": quant.name})
    manifest = {
        "format": CACHE_FORMAT,
        "scheme": quant.name,
        "source": source,
        "num_bytes": tmp_tensors.stat().st_size,
        "sha256": file_sha256(tmp_tensors),
        "num_tensors": len(state),
    }
    os.replace(tmp_tensors, tensor_path)
    tmp_manifest.write_text(json.dumps(manifest))
    os.replace(tmp_manifest, manifest_path)
    log.info("quant_cache.saved", path=str(tensor_path), num_bytes=manifest["num_bytes"])


def check_cache(
    tensor_path: Path, manifest_path: Path, quant: QuantConfig, source: list
) -> str | None:
    """None if the cache may be used, else why not."""
    if not manifest_path.is_file():
        return "no manifest"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError):
        return "unreadable manifest"
    expected = {"format": CACHE_FORMAT, "scheme": quant.name, "source": source}
    for key, value in expected.items():
        if manifest.get(key) != value:
            return f"manifest {key} differs"
    if not tensor_path.is_file() or tensor_path.stat().st_size != manifest.get("num_bytes"):
        return "tensor file missing or of the wrong size"
    if file_sha256(tensor_path) != manifest.get("sha256"):
        return "checksum mismatch"
    return None


def load_quantized(model: nn.Module, tensor_path: Path) -> None:
    """Copy the cached canonical tensors into the model's quantized layers (before `pack`)."""
    from safetensors import safe_open

    modules = quant_modules(model)
    with safe_open(str(tensor_path), framework="pt") as f:
        keys = set(f.keys())
        for name, module in modules.items():
            needed = [f"{name}.{k}" for k in module.quantized_state()]
            missing = [k for k in needed if k not in keys]
            if missing:
                raise ValueError(f"quantized cache {tensor_path} lacks {missing}")
            tensors = [f.get_tensor(k) for k in needed]
            module.load_quantized(0, *tensors)


def remove_cache(tensor_path: Path, manifest_path: Path) -> None:
    manifest_path.unlink(missing_ok=True)
    tensor_path.unlink(missing_ok=True)
