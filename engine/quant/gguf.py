"""GGUF weights, read from the file itself: no float copy on disk, no float round trip for the
block types our int4 layout holds exactly.

Which scheme a GGUF model runs in by default (`native_scheme`): its projections' own type.
Q4_0, Q4_1 and the other <= 4.5-bit types -> int4 (group 32); Q8_0 and the other 5-8-bit
types -> int8; F32 / F16 / BF16 -> no quantization. The type covering most projection weights
decides (llama.cpp's Q4_K_M mixes Q4_K with some Q6_K).

How each projection tensor lands in a quantized layer (`load_quantized_layers`):
- Q4_1 into int4 g32, exactly: a block is 20 bytes, scale d (fp16), minimum m (fp16), 16
  bytes of nibbles (byte j: element j low, element j + 16 high); w = d * q + m, which is our
  canonical int4 group (engine/quant/primitives.py): codes copied, d and m widened (exact).
- Q4_0 into int4 g32, exactly: an 18-byte block, d (fp16) and the same nibbles; w = d * (q - 8),
  so scale d and minimum -8 d (exact in float32: an 11-bit mantissa times 4 bits).
- Anything else gguf's own `dequantize` reads (Q8_0, Q5_*, K-quants, IQ*, floats) is
  dequantized in memory and quantized by the layer (`weight_loader`): Q8_0's per-block scales do
  not fit our per-output-channel int8 row, so Q8_0 -> int8 requantizes (the accuracy cost is
  measured in loadtest/JOURNAL.md). Types gguf cannot dequantize are refused by name.
The non-projection tensors (embeddings, norms, biases) are dequantized in memory
(`iter_float_tensors`), and so is everything when no quantization is asked for (the fp32
oracle path).

llama.cpp stores the q and k projections of "llama" models with their rows permuted for its
rotary layout; the permutation moves whole rows, so it is undone on codes, scales and minimums
alike (as transformers does on the float weights).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import structlog
import torch
from torch import nn

from engine.quant.primitives import quantize_int4_groupwise, quantize_int8_per_channel

log = structlog.get_logger(__name__)

Q4_1_BLOCK_BYTES = 20
Q4_0_BLOCK_BYTES = 18
Q8_0_BLOCK_BYTES = 34
GGUF_BLOCK_SIZE = 32

# GGUF tensor (per block) -> HF checkpoint tensor (per layer), the names load_weights maps.
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_IGNORED_TENSORS = ("rope_freqs.weight",)  # llama 3 rope scaling: in the config instead
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
PERMUTED_ARCHITECTURES = ("llama",)  # llama.cpp permutes q/k rows for these only
SUPPORTED_ARCHITECTURES = ("llama", "qwen2")

# Default scheme by the projections' block type (names of gguf.GGMLQuantizationType).
_INT4_TYPES = ("Q4_0", "Q4_1", "Q2_K", "Q3_K", "Q4_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS",
               "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4",
               "NVFP4")  # fmt: skip
_INT8_TYPES = ("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0")
_FLOAT_TYPES = ("F32", "F16", "BF16")


def hf_name(gguf_name: str) -> str | None:
    """The HF checkpoint name of a GGUF tensor; None for tensors that carry nothing we load."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    if gguf_name in _IGNORED_TENSORS:
        return None
    match = _LAYER_NAME.match(gguf_name)
    if match is None or match.group(2) not in _LAYER_TENSORS:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no counterpart in Mini-Infer's models")
    layer, kind, what = match.groups()
    return f"model.layers.{layer}.{_LAYER_TENSORS[kind]}.{what}"


def architecture(index) -> str:
    """The file's architecture (a GGUFIndex's), if Mini-Infer reads its tensor names."""
    arch = index.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; supported: {SUPPORTED_ARCHITECTURES}"
        )
    return arch


def _reader(gguf_path: Path):
    from engine.quant.gguf_index import read_index

    return read_index(gguf_path)  # parsed once per file version; tensors mapped when read


def native_scheme(gguf_path: Path) -> str | None:
    """The scheme ("int4" | "int8" | None: float) matching the projections' block type."""
    counts: dict[str, int] = {}
    for tensor in _reader(gguf_path).tensors:
        match = _LAYER_NAME.match(tensor.name)
        if match and match.group(2) in _PROJECTIONS and match.group(3) == "weight":
            name = tensor.tensor_type.name
            counts[name] = counts.get(name, 0) + int(tensor.n_elements)
    if not counts:
        return None
    dominant = max(counts, key=counts.__getitem__)
    if dominant in _INT4_TYPES:
        return "int4"
    if dominant in _INT8_TYPES:
        return "int8"
    if dominant in _FLOAT_TYPES:
        return None
    raise ValueError(f"GGUF {gguf_path.name}: projections of type {dominant}, {_SUPPORTED_TEXT}")


_SUPPORTED_TEXT = (
    "supported: Q4_0, Q4_1 (loaded as they are into int4), Q8_0 (-> int8), F32, F16, BF16, and "
    "what the gguf package dequantizes (Q5_0, Q5_1, K-quants, IQ*: quantized again to int4/int8)"
)


DEQUANTIZE_ROWS = 1024  # rows per chunk: gguf's temporaries stay small beside the output


def dequantize(tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[rows, cols] (or [n] for 1-d tensors) of a GGUF tensor in `dtype`, dequantized by the
    gguf package in chunks of rows (its temporaries are several times a chunk's float size),
    each chunk cast as it lands: a bf16 table never exists in float32 whole (SmolLM2's
    embedding: 113 MB of float32 on the load's peak RSS for a 56 MB bf16 parameter)."""
    data = tensor.data
    if data.ndim < 2 or data.shape[0] <= DEQUANTIZE_ROWS:
        return next(dequantized_rows(tensor, dtype, data.shape[0] if data.ndim else 1))[1]
    out = None
    for start, chunk in dequantized_rows(tensor, dtype):
        if out is None:
            out = torch.empty((data.shape[0], *chunk.shape[1:]), dtype=dtype)
        out[start : start + chunk.shape[0]] = chunk
    return out


def dequantized_rows(tensor, dtype: torch.dtype, rows: int = DEQUANTIZE_ROWS):
    """(first row, rows [n, cols] in `dtype`) of a 2-d GGUF tensor, `rows` at a time (a 1-d
    tensor: one chunk): the values `dequantize` gives, without the whole tensor at once.
    Floats and Q8_0 (the default model's embedding table) are decoded here, the same values
    as gguf's; other types by gguf (importing it only then: gguf_index.BlockType)."""
    data = tensor.data
    decode = _OWN_DECODERS.get(tensor.tensor_type.name)
    if decode is not None:
        if data.ndim < 2:
            yield 0, decode(np.asarray(data)).to(dtype)
            return
        for start in range(0, data.shape[0], rows):
            yield start, decode(np.asarray(data[start : start + rows])).to(dtype)
        return
    from gguf.quants import dequantize as gguf_dequantize

    try:
        if data.ndim < 2:
            values = gguf_dequantize(np.asarray(data), tensor.tensor_type)
            yield 0, torch.from_numpy(np.array(values, dtype=np.float32, copy=True)).to(dtype)
            return
        for start in range(0, data.shape[0], rows):
            chunk = gguf_dequantize(np.asarray(data[start : start + rows]), tensor.tensor_type)
            yield start, torch.from_numpy(np.array(chunk, dtype=np.float32, copy=True)).to(dtype)
    except NotImplementedError as error:
        raise ValueError(
            f"GGUF tensor {tensor.name!r} has type {tensor.tensor_type.name}: {_SUPPORTED_TEXT}"
        ) from error


def _decode_q8_0(raw: np.ndarray) -> torch.Tensor:
    """Q8_0 blocks [.., bytes] -> float32 values [.., elements]: a 34-byte block is a scale d
    (fp16) and 32 int8 codes, w = d * q (in float32, as gguf computes it)."""
    blocks = _blocks(raw, Q8_0_BLOCK_BYTES)
    scales = torch.from_numpy(_fp16_field(blocks, 0)).unsqueeze(-1)
    codes = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:]).view(np.int8))
    return (scales * codes).reshape(*raw.shape[:-1], -1)


def _decode_float(raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(raw, dtype=np.float32, copy=True))


_OWN_DECODERS = {"F32": _decode_float, "F16": _decode_float, "Q8_0": _decode_q8_0}


def _unpermute_if_needed(t: torch.Tensor, gguf_name: str, arch: str, hf_config) -> torch.Tensor:
    if arch not in PERMUTED_ARCHITECTURES:
        return t
    if ".attn_q." in gguf_name:
        return unpermute_rows(t, hf_config.num_attention_heads)
    if ".attn_k." in gguf_name:
        return unpermute_rows(t, hf_config.num_key_value_heads)
    return t


def unpermute_rows(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's rotary row permutation of a q/k weight ([out, ...] rows)."""
    half = t.shape[0] // num_heads // 2
    return t.reshape(num_heads, half, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def iter_float_tensors(
    gguf_path: Path,
    hf_config,
    skip: Callable[[str], bool] = lambda name: False,
    dtype_of: Callable[[str], torch.dtype] = lambda name: torch.float32,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF checkpoint name, float tensor in `dtype_of(name)`) for every tensor of the file,
    dequantized one at a time; tensors whose name `skip` accepts are not read at all."""
    reader = _reader(gguf_path)
    arch = architecture(reader)
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None or skip(name):
            continue
        values = dequantize(tensor, dtype_of(name))
        yield name, _unpermute_if_needed(values, tensor.name, arch, hf_config)


# -- projections straight into the quantized layers -----------------------------------------


def decode_q4_1(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """raw uint8 [rows, num_blocks * 20] -> (codes uint8 [rows, num_blocks * 32], scale,
    minimum float32 [rows, num_blocks])."""
    blocks = _blocks(raw, Q4_1_BLOCK_BYTES)
    scale = _fp16_field(blocks, 0)
    minimum = _fp16_field(blocks, 2)
    return _nibbles(blocks[..., 4:]), torch.from_numpy(scale), torch.from_numpy(minimum)


def decode_q4_0(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """raw uint8 [rows, num_blocks * 18] -> (codes, scale d, minimum -8 d): w = d * (q - 8)."""
    blocks = _blocks(raw, Q4_0_BLOCK_BYTES)
    scale = _fp16_field(blocks, 0)
    return _nibbles(blocks[..., 2:]), torch.from_numpy(scale), torch.from_numpy(-8.0 * scale)


def _blocks(raw: np.ndarray, block_bytes: int) -> np.ndarray:
    """Bytes [.., row bytes] -> blocks [.., blocks per row, block_bytes] (a 1-d tensor too)."""
    return np.ascontiguousarray(raw).reshape(*raw.shape[:-1], -1, block_bytes)


def _fp16_field(blocks: np.ndarray, offset: int) -> np.ndarray:
    return blocks[..., offset : offset + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(nibbles: np.ndarray) -> torch.Tensor:
    # nibbles [rows, num_blocks, 16] -> codes uint8 [rows, num_blocks * 32]
    codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)
    return torch.from_numpy(codes.reshape(nibbles.shape[0], -1))


_DECODERS = {"Q4_0": decode_q4_0, "Q4_1": decode_q4_1}


def loads_as_is(gguf_path: Path, quant) -> bool:
    """Whether every projection of the file goes into `quant`'s layers without requantizing."""
    if quant.scheme != "int4" or quant.group_size != GGUF_BLOCK_SIZE:
        return False
    types = {
        t.tensor_type.name
        for t in _reader(gguf_path).tensors
        if (m := _LAYER_NAME.match(t.name)) and m.group(2) in _PROJECTIONS
    }
    return bool(types) and types <= set(_DECODERS)


def load_quantized_layers(
    model: nn.Module,
    gguf_path: Path,
    hf_config,
    on_filled: Callable | None = None,
    head_from_file: bool = False,
) -> dict[str, int]:
    """Fill every quantized layer of `model` from the GGUF: Q4_0/Q4_1 blocks into int4 g32 as
    they are, other types dequantized and quantized by the layer. A tied lm_head is quantized
    from the (already loaded) embedding table, or with `head_from_file` from the file's table
    rows, chunk by chunk in the table's dtype (the same values; the table itself was not
    loaded: its 56 MB were on the load's peak for SmolLM2). Returns {"as_is": n,
    "requantized": n}.

    `on_filled(module)` runs as soon as a layer has all its rows (all its shards): packing it
    there frees its canonical tensors before the next layer's are read, so the load's peak
    holds one layer in both forms instead of every layer's canonical codes (1 byte per weight
    and float32 scales) beside the packed ones."""
    from engine.loader import _map_name
    from engine.quant.cache import quant_modules

    modules = quant_modules(model)
    mapping = getattr(model, "packed_modules_mapping", {})
    reader = _reader(gguf_path)
    arch = architecture(reader)
    counts = {"as_is": 0, "requantized": 0}
    filled: set[str] = set()
    rows_left = {name: module.out_features for name, module in modules.items()}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None or not name.endswith(".weight"):
            continue
        module_name, shard = _map_name(name, mapping)
        module_name = module_name.rpartition(".")[0]
        module = modules.get(module_name)
        if module is None:
            continue
        decoder = _DECODERS.get(tensor.tensor_type.name)
        start, size = module._rows(shard)
        if decoder is not None and module.scheme == "int4" and module.quant.group_size == 32:
            codes, scale, minimum = (
                _unpermute_if_needed(t, tensor.name, arch, hf_config)
                for t in decoder(np.asarray(tensor.data))
            )
            if tuple(codes.shape) != (size, module.in_features):
                raise ValueError(
                    f"GGUF {tensor.name}: {tuple(codes.shape)} vs {(size, module.in_features)}"
                )
            module.load_quantized(start, codes, scale, minimum)
            counts["as_is"] += 1
        else:
            weight = _unpermute_if_needed(dequantize(tensor), tensor.name, arch, hf_config)
            module.weight_loader(module.weight, weight, shard)
            counts["requantized"] += 1
        filled.add(module_name)
        rows_left[module_name] -= size
        if rows_left[module_name] == 0 and on_filled is not None:
            on_filled(module)
    table_rows = None
    if head_from_file:
        table = next(
            (t for t in reader.tensors if hf_name(t.name) == "model.embed_tokens.weight"), None
        )
        if table is None:
            raise ValueError(f"GGUF {gguf_path} has no token embedding table")
        dtype = model.get_submodule("model.embed_tokens").weight.dtype
        table_rows = dequantized_rows(table, dtype)
    if _fill_tied_head(model, modules, filled, table_rows) and on_filled is not None:
        on_filled(modules["lm_head"])
    missing = sorted(set(modules) - filled)
    if missing:
        raise ValueError(f"GGUF {gguf_path} lacks the weights of {missing[:8]}")
    log.info("quant.gguf_loaded", path=str(gguf_path), **counts)
    return counts


def _fill_tied_head(model: nn.Module, modules: dict, filled: set[str], table_rows=None) -> bool:
    """Quantize a tied lm_head from the embedding table (or from `table_rows`: its (first row,
    rows) chunks); whether it did."""
    head = modules.get("lm_head")
    if head is None or "lm_head" in filled or not getattr(model, "tie_word_embeddings", False):
        return False
    if table_rows is None:
        # In chunks of rows (quantization is per row): whole, its float32 temporaries were
        # several times the 113 MB of SmolLM2's table, all on the load's peak RSS.
        table = model.get_submodule("model.embed_tokens").weight.data
        table_rows = (
            (start, table[start : start + DEQUANTIZE_ROWS])
            for start in range(0, table.shape[0], DEQUANTIZE_ROWS)
        )
    for start, rows in table_rows:
        if head.scheme == "int4":
            head.load_quantized(start, *quantize_int4_groupwise(rows, head.quant.group_size))
        else:
            head.load_quantized(start, *quantize_int8_per_channel(rows))
    filled.add("lm_head")
    return True
