"""Quantized weights and KV cache.

`load_model_weights` is the one entry point the model runner calls: it fills a model built
with a `QuantConfig` from the quantized cache when a valid one exists, and otherwise from the
checkpoint (quantizing on the fly), then writes the cache. A GGUF whose blocks our layout
holds as they are (Q4_0/Q4_1 into int4 g32) needs no cache: it is read straight from the file.
Finally every quantized layer is packed for its kernel.
"""

from __future__ import annotations

import functools
from pathlib import Path

import structlog
from torch import nn

from engine.platform import trim_heap
from engine.quant.config import SCHEMES, QuantConfig
from engine.quant.embedding import can_share, share_head_codes

__all__ = ["SCHEMES", "QuantConfig", "load_model_weights"]

log = structlog.get_logger(__name__)


def load_model_weights(
    model: nn.Module,
    model_path: Path,
    quant: QuantConfig | None,
    cache_root: Path | None = None,
    pack: bool = True,
    keep_torch_layout: bool = False,
    embedding_from_head: bool = False,
) -> str:
    """Load `model`'s weights; returns where the quantized tensors came from: "none" (float
    model), "gguf" (the GGUF's blocks as they are), "cache", or "quantized" (freshly, from the
    float or GGUF weights, then cached). `pack=False` leaves the quantized layers in their
    canonical form (tests compare those tensors); `keep_torch_layout`: see QuantLinear.pack.
    `embedding_from_head`: a tied embedding is replaced by the lookup in the int8 head's codes
    (engine/quant/embedding.py) as soon as the head is filled, before it is packed, so the
    float table and two copies of the codes are never resident together."""
    from engine.loader import gguf_source, load_weights
    from engine.quant import cache, gguf

    if quant is None:
        load_weights(model, model_path)
        return "none"
    gguf_file = gguf_source(model_path)  # first: it may fetch the default model's GGUF
    skip = frozenset(cache.quant_modules(model))
    if gguf_file is not None and gguf.loads_as_is(gguf_file, quant):
        # The GGUF is the quantized cache: memory-mapped, no second file, nothing to rebuild.
        # Each layer is packed once filled (nothing needs the canonical form afterwards).
        on_filled = functools.partial(
            _pack_and_trim, keep_torch_layout=keep_torch_layout,
            model=model if embedding_from_head else None,
        )  # fmt: skip
        on_filled = on_filled if pack else None
        # The tied table is read from the file straight into the head's codes, never loaded.
        head_from_file = embedding_from_head and pack and can_share(model)
        _load_from_gguf(model, model_path, gguf_file, skip, on_filled, head_from_file)
        origin = "gguf"
    else:
        origin = _load_through_cache(model, model_path, quant, cache_root, gguf_file, skip)
    if embedding_from_head:
        share_head_codes(model)
    for module in cache.quant_modules(model).values():
        if pack:
            module.pack(keep_torch_layout)
    log.info("quant.loaded", scheme=quant.name, origin=origin)
    return origin


def _pack_and_trim(module: nn.Module, keep_torch_layout: bool, model=None) -> None:
    """Pack a layer as soon as it is filled and hand its canonical tensors' pages back; with
    `model`, its tied embedding table goes first once the head is filled (`share_head_codes`)."""
    if model is not None and module is getattr(model, "lm_head", None):
        share_head_codes(model)
    module.pack(keep_torch_layout)
    trim_heap()


def _load_from_gguf(
    model: nn.Module, model_path: Path, gguf_file: Path, skip, on_filled=None,
    head_from_file: bool = False,
) -> None:  # fmt: skip
    from engine.loader import load_weights
    from engine.model_config import load_config
    from engine.quant import gguf

    if head_from_file:
        skip = skip | {"model.embed_tokens"}
    load_weights(model, model_path, skip_modules=skip)  # embeddings, norms, biases
    if on_filled is not None:  # packing as it goes: trimming as it goes too
        trim_heap()
    hf_config = load_config(model_path)
    gguf.load_quantized_layers(model, gguf_file, hf_config, on_filled, head_from_file)


def _load_through_cache(
    model: nn.Module, model_path: Path, quant: QuantConfig, cache_root, gguf_file, skip
) -> str:
    """Quantize once (from the float checkpoint or the GGUF), keep the result in the cache."""
    from engine.loader import _file_lock, cache_dir, load_weights
    from engine.quant import cache

    root = Path(cache_root) if cache_root is not None else cache_dir() / "quantized"
    tensor_path, manifest_path = cache.cache_paths(root, model_path, quant)
    source = cache.source_fingerprint(model_path)
    tensor_path.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(tensor_path.parent / f".{quant.name}.lock"):
        problem = cache.check_cache(tensor_path, manifest_path, quant, source)
        if problem is None:
            load_weights(model, model_path, skip_modules=skip)
            cache.load_quantized(model, tensor_path)
            return "cache"
        if problem != "no manifest" or tensor_path.exists():
            log.warning("quant_cache.rebuild", path=str(tensor_path), reason=problem)
        cache.remove_cache(tensor_path, manifest_path)
        if gguf_file is not None:
            _load_from_gguf(model, model_path, gguf_file, skip)
        else:
            load_weights(model, model_path)  # quantizes every layer from the float weights
        cache.save_quantized(model, tensor_path, manifest_path, quant, source)
    return "quantized"
