"""GGUF Q4_1 blocks become int4 (group 32) codes, scales and minimums exactly: what the
`gguf` package writes is what we load, with no float round trip."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize
from transformers import AutoConfig

from engine.layers.attention import TorchPagedAttention
from engine.models import get_model_class
from engine.quant.config import QuantConfig
from engine.quant.gguf import decode_q4_1, load_q4_1, unpermute_rows
from engine.quant.primitives import dequantize_int4
from tests.tiny_model import make_tiny_llama

Q4_1 = GGMLQuantizationType.Q4_1


def _write_gguf(path, tensors: dict[str, np.ndarray]):
    writer = GGUFWriter(str(path), "llama")
    for name, values in tensors.items():
        writer.add_tensor(name, quantize(values, Q4_1), raw_dtype=Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's rotary permutation of q/k rows."""
    return (
        w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def test_q4_1_tensor_loads_into_int4_exactly(tmp_path):
    rng = np.random.default_rng(0)
    values = rng.standard_normal((24, 96)).astype(np.float32)
    _write_gguf(tmp_path / "t.gguf", {"blk.0.ffn_down.weight": values})
    tensor = GGUFReader(str(tmp_path / "t.gguf")).tensors[0]
    assert tensor.tensor_type == Q4_1
    codes, scale, minimum = decode_q4_1(np.asarray(tensor.data))
    assert codes.shape == (24, 96) and scale.shape == (24, 3) and minimum.shape == (24, 3)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
    expected = torch.from_numpy(dequantize(np.asarray(tensor.data), Q4_1).reshape(24, 96))
    assert torch.equal(dequantize_int4(codes, scale, minimum), expected)
    # The fp16 scales and minimums survive bit for bit.
    blocks = np.asarray(tensor.data).reshape(24, 3, 20)
    assert np.array_equal(scale.numpy(), blocks[..., 0:2].copy().view(np.float16)[..., 0])
    assert np.array_equal(minimum.numpy(), blocks[..., 2:4].copy().view(np.float16)[..., 0])


@pytest.mark.parametrize("num_heads", [1, 2, 4])
def test_unpermute_inverts_llama_cpp_permutation(num_heads):
    w = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
    permuted = torch.from_numpy(_llama_cpp_permute(w, num_heads))
    assert torch.equal(unpermute_rows(permuted, num_heads), torch.from_numpy(w))


def test_model_layers_take_q4_1_blocks(tmp_path):
    """q (permuted in the file), k and down_proj of layer 0 come from the GGUF as they are."""
    path = make_tiny_llama(tmp_path / "m", seed=5)
    hf_config = AutoConfig.from_pretrained(path)
    quant = QuantConfig("int4", 32)
    model = get_model_class(hf_config)(hf_config, torch.float32, 64, TorchPagedAttention(), quant)
    rng = np.random.default_rng(1)
    q = rng.standard_normal((64, 64)).astype(np.float32)  # 4 heads x 16
    k = rng.standard_normal((32, 64)).astype(np.float32)  # 2 kv heads x 16
    down = rng.standard_normal((64, 128)).astype(np.float32)
    _write_gguf(tmp_path / "m.gguf", {
        "blk.0.attn_q.weight": _llama_cpp_permute(q, 4),
        "blk.0.attn_k.weight": _llama_cpp_permute(k, 2),
        "blk.0.ffn_down.weight": down,
    })  # fmt: skip
    assert load_q4_1(model, tmp_path / "m.gguf") == 3
    layer = model.model.layers[0]
    weight = layer.self_attn.qkv_proj.dequantized_weight()

    def q4_1(values):
        return torch.from_numpy(dequantize(quantize(values, Q4_1), Q4_1).reshape(values.shape))

    assert torch.equal(weight[:64], q4_1(q))
    assert torch.equal(weight[64:96], q4_1(k))
    assert torch.equal(layer.mlp.down_proj.dequantized_weight(), q4_1(down))
