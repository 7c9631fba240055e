"""A random-weight checkpoint with the shapes of a 1B Llama, for speed benchmarks.

    python -m loadtest.make_bench_model --out DIR [--llama-quantize BIN] [--seed 0]

Writes into DIR a Hugging Face Llama checkpoint with Llama-3.2-1B's shapes (hidden 2048, 16
layers, 32 heads, 8 KV heads, FFN 8192, tied embeddings; ~1.07 B parameters) and SmolLM2's
tokenizer and vocabulary (49152, from the cached default model), bf16 safetensors; in DIR/gguf/
(not DIR itself: the int4 loader takes Q4_1 blocks from a GGUF beside the checkpoint) the same
tensors as an F16 GGUF for llama.cpp (`gguf`'s writer, named and permuted as llama.cpp's
converter does, the tokenizer metadata copied from SmolLM2's GGUF); and, given a
`llama-quantize` binary, that GGUF quantized to Q4_1. Speed does not depend on the values:
weights are N(0, 0.02), norms 1, so activations stay finite. Needs ~5 GB of free memory and
~6.5 GB of disk (bf16 + F16 + Q4_1).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
    "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 64, "hidden_act": "silu", "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "max_position_embeddings": 8192, "tie_word_embeddings": True,
    "attention_bias": False, "mlp_bias": False, "dtype": "bfloat16",
}  # fmt: skip
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "generation_config.json", "special_tokens_map.json")  # fmt: skip
GGUF_F16 = "bench-1b-F16.gguf"
GGUF_Q4_1 = "bench-1b-Q4_1.gguf"


def make_tensors(config: dict, seed: int) -> dict:
    """{HF name: bf16 tensor} for `config`, random N(0, 0.02) matrices and unit norms."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    hidden, ffn = config["hidden_size"], config["intermediate_size"]
    head_dim = config["head_dim"]
    q_out = config["num_attention_heads"] * head_dim
    kv_out = config["num_key_value_heads"] * head_dim

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return torch.empty(rows, cols).normal_(0.0, 0.02, generator=generator).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": matrix(config["vocab_size"], hidden),
               "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}  # fmt: skip
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "self_attn.q_proj.weight": matrix(q_out, hidden),
            p + "self_attn.k_proj.weight": matrix(kv_out, hidden),
            p + "self_attn.v_proj.weight": matrix(kv_out, hidden),
            p + "self_attn.o_proj.weight": matrix(hidden, q_out),
            p + "mlp.gate_proj.weight": matrix(ffn, hidden),
            p + "mlp.up_proj.weight": matrix(ffn, hidden),
            p + "mlp.down_proj.weight": matrix(hidden, ffn),
        }
    return tensors


def _permute(weight, num_heads: int):
    """HF's rotate-half q/k rows -> llama.cpp's interleaved pairs (its converter's permute)."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))  # fmt: skip


_GGUF_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}  # fmt: skip


def gguf_name(name: str) -> str:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    _, _, layer, rest = name.split(".", 3)
    return f"blk.{layer}.{_GGUF_NAMES[rest.removesuffix('.weight')]}.weight"


def write_gguf(path: Path, tensors: dict, config: dict, tokenizer_gguf: Path) -> None:
    """`tensors` as an F16 GGUF (norms F32, as llama.cpp's converter writes them)."""
    import gguf
    import numpy as np
    import torch

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("mini-infer bench 1B (random weights)")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    reader = gguf.GGUFReader(str(tokenizer_gguf))
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub_type = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type)
    for name, tensor in tensors.items():
        array = tensor.to(torch.float32 if tensor.dim() == 1 else torch.float16).numpy()
        if name.endswith("q_proj.weight"):
            array = _permute(array, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            array = _permute(array, config["num_key_value_heads"])
        writer.add_tensor(gguf_name(name), np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main(argv: list[str] | None = None) -> int:
    from engine.loader import DEFAULT_MODEL_GGUF, fetch_default_model

    parser = argparse.ArgumentParser(prog="make_bench_model")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--llama-quantize", type=Path, default=None, help="also write Q4_1")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from safetensors.torch import save_file

    source = fetch_default_model(progress=False)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    source_config = json.loads((source / "config.json").read_text())
    config = {**CONFIG, **{k: source_config[k] for k in
                           ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")}}  # fmt: skip
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, out / name)
    tensors = make_tensors(config, args.seed)
    num_params = sum(t.numel() for t in tensors.values())
    print(f"{num_params / 1e9:.3f} B parameters, {num_params * 2 / 1e9:.2f} GB in bf16", flush=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    print(f"wrote {out / 'model.safetensors'}", flush=True)
    gguf_dir = out / "gguf"
    gguf_dir.mkdir(exist_ok=True)
    write_gguf(gguf_dir / GGUF_F16, tensors, config, source / DEFAULT_MODEL_GGUF)
    print(f"wrote {gguf_dir / GGUF_F16}", flush=True)
    del tensors
    if args.llama_quantize is not None:
        command = [str(args.llama_quantize), str(gguf_dir / GGUF_F16), str(gguf_dir / GGUF_Q4_1),
                   "Q4_1"]  # fmt: skip
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        print(f"wrote {gguf_dir / GGUF_Q4_1}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
