"""bench_1b's GB/s column divides by the bytes each side reads: for the engine's int4 side its
formula must be the bytes the engine's packed weights take, which this test counts."""

from __future__ import annotations

import json

import pytest

from engine.quant.linear import QuantLinear
from loadtest import bench_1b
from loadtest.report import decode_speed


def test_int4_bytes_per_token_are_the_engines_packed_weights(tiny_model_dir):
    from engine import LLMEngine
    from engine.kernels.cpu import quant_gemm

    if quant_gemm.load() is None:
        pytest.skip("the C++ kernels did not build here (no compiler)")
    config = json.loads((tiny_model_dir / "config.json").read_text())
    if config["vocab_size"] % quant_gemm.BLOCK:  # packed blocks of 16 rows would pad it
        pytest.skip("the tiny model's vocabulary is not a whole number of blocks")
    engine = LLMEngine(str(tiny_model_dir), dtype="bfloat16", quantization="int4")
    linears = [m for m in engine.runner.model.modules() if isinstance(m, QuantLinear)]
    assert {m.scheme for m in linears} == {"int4", "int8"}  # the head is int8
    packed = sum(m.cpp_codes.nbytes + m.cpp_scales.nbytes for m in linears)
    assert bench_1b.int4_bytes_per_token(config) == packed


def test_16_bit_bytes_count_every_linear_and_the_head_once():
    config = {"hidden_size": 8, "intermediate_size": 16, "num_attention_heads": 2,
              "num_key_value_heads": 1, "num_hidden_layers": 3, "vocab_size": 10}  # fmt: skip
    # per layer: q 8x8, k and v 4x8 each, o 8x8, gate/up/down 8x16 each
    per_layer = 64 + 32 + 32 + 64 + 3 * 128
    assert bench_1b.weight_bytes_per_token(config) == 2 * (3 * per_layer + 80)


def test_gguf_bytes_of_a_missing_file_is_none(tmp_path):
    assert bench_1b.gguf_bytes(tmp_path / "absent.gguf") is None


def test_decode_speed_is_the_servers_own_or_the_tokens_after_the_first():
    server = {"server_tok_s": {"median": 21.2, "sum": 21.2}, "output_tokens": 128,
              "elapsed_s": 7.0, "ttfts_ms": [1200.0]}  # fmt: skip
    assert decode_speed(server) == 21.2
    engine = {"output_tokens": 128, "elapsed_s": 3.84, "ttfts_ms": [300.0]}
    assert decode_speed(engine) == round(127 / 3.54, 1)
    assert decode_speed({**engine, "ttfts_ms": [300.0, 310.0]}) is None  # two streams
    assert decode_speed({**engine, "output_tokens": 1}) is None
    assert decode_speed({**engine, "ttfts_ms": [3840.0]}) is None

