"""GGUF Q4_1 tensors straight into the int4 (group 32) layout, with no float round trip.

A Q4_1 block is 20 bytes: scale d (fp16), minimum m (fp16), 16 bytes of nibbles: byte j holds
element j in its low nibble and element j + 16 in its high one; w = d * q + m. That is exactly
our canonical int4 group (engine/quant/primitives.py), so the codes are copied and d, m widened
to float32 (exact). llama.cpp stores q and k projections with their rows permuted for its rotary
layout; the permutation moves whole rows, so it is undone on codes, scales and minimums alike
(as transformers does on the float weights).

Only Q4_1 blocks take this path, and only into int4 with group size 32. Every other tensor of
the file (F32 norms, the Q8_0 embedding table of the default model) comes from the float
checkpoint converted from the same file, which dequantizes exactly; a Q8_0 block (32 int8 codes,
one scale) cannot become a per-output-channel int8 row without requantizing, so "int8" quantizes
from that float copy. Types the converter cannot dequantize are refused there, by name.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import structlog
import torch
from torch import nn

from engine.quant.config import QuantConfig

log = structlog.get_logger(__name__)

Q4_1_BLOCK_BYTES = 20
Q4_1_BLOCK_SIZE = 32

# GGUF tensor name (per block) -> (our module name, shard or None)
_BLOCK_TENSORS = {
    "attn_q": ("self_attn.qkv_proj", "q"),
    "attn_k": ("self_attn.qkv_proj", "k"),
    "attn_v": ("self_attn.qkv_proj", "v"),
    "attn_output": ("self_attn.o_proj", None),
    "ffn_gate": ("mlp.gate_up_proj", "gate"),
    "ffn_up": ("mlp.gate_up_proj", "up"),
    "ffn_down": ("mlp.down_proj", None),
}
_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.weight$")


def decode_q4_1(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """raw uint8 [rows, num_blocks * 20] -> (codes uint8 [rows, num_blocks * 32], scale,
    minimum float32 [rows, num_blocks])."""
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, Q4_1_BLOCK_BYTES)
    scale = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    minimum = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    nibbles = blocks[..., 4:]  # [rows, num_blocks, 16]
    codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)  # [rows, num_blocks, 32]
    return (
        torch.from_numpy(codes.reshape(rows, -1).astype(np.uint8)),
        torch.from_numpy(scale),
        torch.from_numpy(minimum),
    )


def unpermute_rows(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's rotary row permutation of a q/k weight ([out, ...] rows)."""
    half = t.shape[0] // num_heads // 2
    return t.reshape(num_heads, half, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def gguf_file_for(model_path: Path) -> Path | None:
    """The GGUF a converted checkpoint came from, if it is still there."""
    from engine.loader import gguf_source

    return gguf_source(Path(model_path))


def q4_1_source(model_path: Path, quant: QuantConfig) -> Path | None:
    """The GGUF to take Q4_1 blocks from, for int4 with group size 32; else None."""
    if quant.scheme != "int4" or quant.group_size != Q4_1_BLOCK_SIZE:
        return None
    return gguf_file_for(model_path)


def load_q4_1(model: nn.Module, gguf_path: Path) -> int:
    """Overwrite the int4 rows of every layer that the GGUF stores as Q4_1 with its blocks, as
    they are. Call after the float load (which filled everything). Returns tensors taken."""
    from gguf import GGMLQuantizationType, GGUFReader

    reader = GGUFReader(str(gguf_path))
    attention = model.get_submodule("model.layers.0.self_attn")
    num_heads, num_kv_heads = attention.num_heads, attention.num_kv_heads
    num_taken = 0
    for tensor in reader.tensors:
        match = _BLOCK_NAME.match(tensor.name)
        if tensor.tensor_type != GGMLQuantizationType.Q4_1 or match is None:
            continue
        layer, kind = int(match.group(1)), match.group(2)
        if kind not in _BLOCK_TENSORS:
            continue
        module_name, shard = _BLOCK_TENSORS[kind]
        module = model.get_submodule(f"model.layers.{layer}.{module_name}")
        codes, scale, minimum = decode_q4_1(np.asarray(tensor.data))
        if kind in ("attn_q", "attn_k"):
            heads = num_heads if kind == "attn_q" else num_kv_heads
            codes, scale, minimum = (unpermute_rows(t, heads) for t in (codes, scale, minimum))
        start, size = module._rows(shard)
        if tuple(codes.shape) != (size, module.in_features):
            raise ValueError(
                f"GGUF {tensor.name}: {tuple(codes.shape)} vs {(size, module.in_features)}"
            )
        module.load_quantized(start, codes, scale, minimum)
        num_taken += 1
    log.info("quant.gguf_q4_1", path=str(gguf_path), num_tensors=num_taken)
    return num_taken
