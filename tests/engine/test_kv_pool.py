"""engine/kv_pool.py: one sizing rule for every device and KV dtype, views per layer."""

from __future__ import annotations

import pytest
import torch

from engine import kv_pool
from engine.config import EngineConfig
from engine.quant import kv_int8

SHAPE = kv_pool.KVPoolShape(num_layers=2, block_size=16, num_kv_heads=2, head_dim=8)
FLOAT_BLOCK = 2 * 2 * 16 * 2 * 8 * 4  # layers x K/V x block x heads x head_dim x fp32 bytes


def test_bytes_per_block():
    assert SHAPE.bytes_per_block(torch.float32, "auto") == FLOAT_BLOCK
    assert SHAPE.bytes_per_block(torch.bfloat16, "auto") == FLOAT_BLOCK // 2
    assert SHAPE.bytes_per_block(torch.float32, "int8") == kv_int8.bytes_per_block(2, 16, 2, 8)


@pytest.mark.parametrize(
    ("config", "max_model_len", "expected"),
    [
        # what the sequences can use: 2 sequences x cdiv(100, 16) blocks
        (EngineConfig(max_num_seqs=2, kv_cache_memory_bytes=1 << 30), 100, 14),
        # the budget caps it
        (EngineConfig(max_num_seqs=2, kv_cache_memory_bytes=10 * FLOAT_BLOCK + 5), 1024, 10),
        # never empty
        (EngineConfig(kv_cache_memory_bytes=1), 1024, 1),
    ],
)
def test_default_num_kv_blocks(config, max_model_len, expected):
    assert kv_pool.default_num_kv_blocks(config, max_model_len, FLOAT_BLOCK) == expected


@pytest.mark.parametrize("device", ["cpu", "meta"])  # meta: the torch.zeros path of a GPU
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_allocate_sizes_every_device_alike(device, kv_cache_dtype):
    config = EngineConfig(
        max_num_seqs=2, kv_cache_memory_bytes=1 << 30, kv_cache_dtype=kv_cache_dtype
    )
    pool = kv_pool.allocate(SHAPE, config, 100, torch.float32, torch.device(device))
    assert pool.num_kv_blocks == 14
    assert pool.num_bytes == 14 * SHAPE.bytes_per_block(torch.float32, kv_cache_dtype)
    assert pool.cache.shape == (2, 14, 16, 2, 2, 8) and pool.cache.device.type == device
    assert len(pool.layer_caches) == 2
    if kv_cache_dtype == "int8":
        assert pool.cache.dtype == torch.int8 and pool.scales.shape == (2, 14, 16, 2, 2)
        assert isinstance(pool.layer_caches[1], kv_int8.Int8KVCache)
    else:
        assert pool.scales is None
        assert pool.layer_caches[1].data_ptr() == pool.cache[1].data_ptr()  # a view


def test_cpu_pool_is_zero_and_pinned_count_wins():
    config = EngineConfig(num_kv_blocks=3, kv_cache_memory_bytes=1)
    pool = kv_pool.allocate(SHAPE, config, 1024, torch.bfloat16, torch.device("cpu"))
    assert pool.num_kv_blocks == 3 and not pool.cache.any()


def test_attach_hands_each_layer_its_slice():
    layers = torch.nn.ModuleList(torch.nn.Module() for _ in range(2))
    for layer in layers:
        layer.kv_cache = None
    pool = kv_pool.allocate(SHAPE, EngineConfig(num_kv_blocks=2), 64, torch.float32,
                            torch.device("cpu"))  # fmt: skip
    kv_pool.attach(layers, pool)
    assert [layer.kv_cache for layer in layers] == pool.layer_caches
    with pytest.raises(ValueError):  # a pool for another layer count
        kv_pool.attach(torch.nn.ModuleList([layers[0]]), pool)
