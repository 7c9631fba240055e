"""TritonPagedAttention (interpreter) against TorchPagedAttention on one mixed step: decodes at
block boundaries, a fresh prefill and extends after cached prefixes, with metadata from the
runner's own prepare_step."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.triton.backend import TritonPagedAttention
from engine.layers.attention import TorchPagedAttention
from tests.engine.kernels.triton_cases import MIXED_STEP, mixed_step


@pytest.mark.parametrize("with_context_lens", [False, True], ids=["lens-from-mask", "lens-given"])
def test_mixed_step_matches_torch_backend(with_context_lens):
    gen = torch.Generator().manual_seed(0)
    block_size, num_kv_heads, head_dim = 16, 2, 64
    batch, q, kv, num_blocks = mixed_step(gen, block_size, 6, num_kv_heads, head_dim)
    if with_context_lens:
        batch.meta.decode_context_lens = torch.tensor([s + 1 for s, n in MIXED_STEP if n == 1])
    cache = torch.randn(num_blocks, block_size, 2, num_kv_heads, head_dim, generator=gen)
    torch_cache, triton_cache = cache.clone(), cache.clone()

    expected = TorchPagedAttention().forward(q, kv, torch_cache, batch.meta)
    out = TritonPagedAttention().forward(q, kv, triton_cache, batch.meta)

    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
    assert torch.equal(triton_cache, torch_cache)  # the same slots written with the same K/V


def test_unusable_without_gpu_or_interpreter(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the backend is usable")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        TritonPagedAttention()
