"""Quantized weights and KV cache.

`load_model_weights` is the one entry point the model runner calls: it fills a model built
with a `QuantConfig` from the quantized cache when a valid one exists, and otherwise from the
checkpoint (quantizing on the fly, or taking GGUF Q4_1 blocks as they are), then writes the
cache; finally every quantized layer is packed for its kernel.
"""

from __future__ import annotations

from pathlib import Path

import structlog
from torch import nn

from engine.quant.config import SCHEMES, QuantConfig

__all__ = ["SCHEMES", "QuantConfig", "load_model_weights"]

log = structlog.get_logger(__name__)


def load_model_weights(
    model: nn.Module,
    model_path: Path,
    quant: QuantConfig | None,
    cache_root: Path | None = None,
    pack: bool = True,
) -> str:
    """Load `model`'s weights; returns where the quantized tensors came from: "none" (float
    model), "cache", "gguf" or "quantized" (freshly, then cached). `pack=False` leaves the
    quantized layers in their canonical form (tests compare those tensors)."""
    from engine.loader import _file_lock, cache_dir, load_weights
    from engine.quant import cache, gguf

    if quant is None:
        load_weights(model, model_path)
        return "none"
    root = Path(cache_root) if cache_root is not None else cache_dir() / "quantized"
    tensor_path, manifest_path = cache.cache_paths(root, model_path, quant)
    gguf_file = gguf.q4_1_source(model_path, quant)  # first: it may fetch the GGUF
    source = cache.source_fingerprint(model_path)
    skip = frozenset(cache.quant_modules(model))
    tensor_path.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(tensor_path.parent / f".{quant.name}.lock"):
        problem = cache.check_cache(tensor_path, manifest_path, quant, source)
        if problem is None:
            load_weights(model, model_path, skip_modules=skip)
            cache.load_quantized(model, tensor_path)
            origin = "cache"
        else:
            if problem != "no manifest" or tensor_path.exists():
                log.warning("quant_cache.rebuild", path=str(tensor_path), reason=problem)
            cache.remove_cache(tensor_path, manifest_path)
            load_weights(model, model_path)  # quantizes every layer from the float weights
            if gguf_file is not None:
                # ...then the layers the GGUF holds as Q4_1 take its blocks as they are.
                gguf.load_q4_1(model, gguf_file)
                origin = "gguf"
            else:
                origin = "quantized"
            cache.save_quantized(model, tensor_path, manifest_path, quant, source)
    for module in cache.quant_modules(model).values():
        if pack:
            module.pack()
    log.info("quant.loaded", scheme=quant.name, origin=origin)
    return origin
