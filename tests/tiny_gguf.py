"""Tiny GGUF models for tests: the weights of a tiny random Llama checkpoint (tests/tiny_model.py)
written by the `gguf` package's own writer in a chosen block type, q/k rows permuted the way
llama.cpp's converter does, beside the checkpoint's config and tokenizer (and no safetensors):
the layout `mini-infer` makes of a GGUF file (engine/loader.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from safetensors.torch import load_file
from transformers import AutoConfig

_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}  # fmt: skip
PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's rotary permutation of q/k rows."""
    return (
        w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, str]], arch: str = "llama"):
    """tensors: GGUF name -> (float32 values, or raw uint8 blocks, block type name)."""
    writer = GGUFWriter(str(path), arch)
    for name, (values, type_name) in tensors.items():
        qtype = GGMLQuantizationType[type_name]
        if values.dtype == np.uint8:  # raw blocks, written as they are
            writer.add_tensor(name, values, raw_dtype=qtype)
        elif qtype == GGMLQuantizationType.F32:
            writer.add_tensor(name, values.astype(np.float32))
        else:
            writer.add_tensor(name, quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_tensors(checkpoint: Path, projection_type: str) -> dict[str, tuple[np.ndarray, str]]:
    """The checkpoint's weights by GGUF name: projections in `projection_type`, the embedding
    table Q8_0 (as in the default model) unless the projections are F32, norms F32."""
    config = AutoConfig.from_pretrained(checkpoint)
    out = {}
    for key, tensor in load_file(Path(checkpoint) / "model.safetensors").items():
        values = tensor.float().numpy()
        if key == "model.embed_tokens.weight":
            out["token_embd.weight"] = (values, "F32" if projection_type == "F32" else "Q8_0")
        elif key == "model.norm.weight":
            out["output_norm.weight"] = (values, "F32")
        elif key == "lm_head.weight":
            out["output.weight"] = (values, projection_type)
        else:
            layer, _, rest = key.removeprefix("model.layers.").partition(".")
            module = rest.rpartition(".")[0]
            kind = _GGUF_NAMES[module]
            if kind == "attn_q":
                values = llama_cpp_permute(values, config.num_attention_heads)
            elif kind == "attn_k":
                values = llama_cpp_permute(values, config.num_key_value_heads)
            out[f"blk.{layer}.{kind}.weight"] = (
                values, projection_type if kind in PROJECTIONS else "F32"
            )  # fmt: skip
    return out


def make_gguf_model(checkpoint: Path, out_dir: Path, projection_type: str) -> Path:
    """A GGUF-backed model directory (config, tokenizer, model.gguf) from a tiny checkpoint."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True)
    for item in Path(checkpoint).iterdir():
        if item.suffix != ".safetensors":
            shutil.copy(item, out_dir / item.name)
    write_gguf(out_dir / "model.gguf", gguf_tensors(checkpoint, projection_type))
    return out_dir
