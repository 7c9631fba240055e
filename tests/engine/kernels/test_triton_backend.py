"""TritonPagedAttention (interpreter) against TorchPagedAttention on one mixed step: decodes at
block boundaries, a fresh prefill and extends after cached prefixes, with metadata from the
runner's own prepare_step."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.triton.backend import TritonPagedAttention
from engine.layers.attention import TorchPagedAttention
from engine.model_runner import prepare_step
from engine.sampling_params import SamplingParams
from engine.scheduler_output import ScheduledRequest


@pytest.mark.parametrize("with_context_lens", [False, True], ids=["lens-from-mask", "lens-given"])
def test_mixed_step_matches_torch_backend(with_context_lens):
    gen = torch.Generator().manual_seed(0)
    block_size, num_heads, num_kv_heads, head_dim = 16, 6, 2, 64
    # (start_position, num_new_tokens): decodes at 1, 16, 17 and 40 tokens of context, a fresh
    # 20-token prefill, extends of 9 tokens after 16 cached and 5 after 33.
    specs = [(0, 1), (15, 1), (16, 1), (39, 1), (0, 20), (16, 9), (33, 5)]
    num_blocks = sum(-(-(s + n) // block_size) for s, n in specs) + 2
    free = torch.randperm(num_blocks, generator=gen).tolist()
    requests = []
    for i, (start, n) in enumerate(specs):
        ids = [free.pop() for _ in range(-(-(start + n) // block_size))]
        requests.append(
            ScheduledRequest(f"r{i}", [1] * n, start, ids, True, SamplingParams(), seed=0)
        )
    batch = prepare_step(requests, block_size)
    if with_context_lens:
        batch.meta.decode_context_lens = torch.tensor([s + 1 for s, n in specs if n == 1])
    num_tokens = sum(n for _, n in specs)
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen)
    q = qkv[:, :num_heads]  # strided views, as the model passes them
    kv = qkv[:, num_heads:].view(num_tokens, 2, num_kv_heads, head_dim)
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
