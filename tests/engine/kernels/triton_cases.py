"""Shared builders for the Triton kernel tests, which run on a CUDA GPU when there is one, else
in Triton's interpreter (switched on by tests/conftest.py before anything imports Triton): a
paged KV cache poisoned with NaN outside the slots a case uses (a kernel that reads past a
context end, or a padded table entry, turns the output NaN) and tolerances per dtype."""

from __future__ import annotations

import torch

# The kernels run on the GPU when there is one, else in the interpreter on CPU tensors.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# fp32: the kernels and the references differ only in summation order.
# bf16: probabilities and outputs are rounded to bf16 (2^-8 relative each), and the interpreter
# rounds float->bf16 by truncation (up to 2^-7 relative), so about two ulps of an O(1) output.
TOLERANCES = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-4},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}
# Row-wise kernels (norm, RoPE, SiLU*mul) round where the torch path rounds: fp32 agrees to
# float rounding; bf16 to three ulps (2^-5 relative): a result passes two or three roundings
# (residual add, normalised value, weight product), each of which the interpreter truncates where
# torch rounds to nearest (a GPU rounds to nearest too). Hypothesis found a 3-ulp case
# (hidden 1000, with residual): two ulps was too tight.
POINTWISE_TOLERANCES = {
    torch.float32: {"atol": 1e-6, "rtol": 1e-5},
    torch.bfloat16: {"atol": 2**-6, "rtol": 2**-5},
}


def context_len(kind: str, block_size: int) -> int:
    """Lengths at block boundaries: 1, block_size - 1, block_size, block_size + 1, many."""
    return {
        "one": 1,
        "below": block_size - 1,
        "at": block_size,
        "above": block_size + 1,
        "many": 5 * block_size + 3,
    }[kind]


def paged_cache(
    lens: list[int], block_size: int, num_kv_heads: int, head_dim: int, dtype, generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_cache, block_tables): each sequence gets its own shuffled blocks; slots past each
    length, and blocks nobody owns, hold NaN; table padding points at an all-NaN block."""
    blocks_per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks_per_seq) + 2
    cache = torch.full((num_blocks, block_size, 2, num_kv_heads, head_dim), float("nan"))
    order = torch.randperm(num_blocks, generator=generator).tolist()
    nan_block = order.pop()
    width = max(blocks_per_seq)
    tables = torch.full((len(lens), width), nan_block, dtype=torch.int64)
    for i, (n, count) in enumerate(zip(lens, blocks_per_seq, strict=True)):
        ids = [order.pop() for _ in range(count)]
        tables[i, :count] = torch.tensor(ids)
        for pos in range(n):
            cache[ids[pos // block_size], pos % block_size] = torch.randn(
                2, num_kv_heads, head_dim, generator=generator
            )
    return cache.to(dtype).to(DEVICE), tables.to(DEVICE)


# (start_position, num_new_tokens): decodes at 1, 16, 17 and 40 tokens of context, a fresh
# 20-token prefill, extends of 9 tokens after 16 cached and 5 after 33.
MIXED_STEP = [(0, 1), (15, 1), (16, 1), (39, 1), (0, 20), (16, 9), (33, 5)]


def mixed_step(generator, block_size=16, num_heads=6, num_kv_heads=2, head_dim=64):
    """(batch, q, kv, num_blocks) of one step of MIXED_STEP with the runner's own metadata
    (`prepare_step`) over shuffled blocks; q and kv are strided views of one fused projection
    output, as the model passes them."""
    from engine.sampling_params import SamplingParams
    from engine.scheduler_output import ScheduledRequest
    from engine.step_batch import prepare_step

    num_blocks = sum(-(-(s + n) // block_size) for s, n in MIXED_STEP) + 2
    free = torch.randperm(num_blocks, generator=generator).tolist()
    requests = []
    for i, (start, n) in enumerate(MIXED_STEP):
        ids = [free.pop() for _ in range(-(-(start + n) // block_size))]
        requests.append(
            ScheduledRequest(f"r{i}", [1] * n, start, ids, True, SamplingParams(), seed=0)
        )
    batch = prepare_step(requests, block_size)
    num_tokens = sum(n for _, n in MIXED_STEP)
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=generator)
    q = qkv[:, :num_heads]
    kv = qkv[:, num_heads:].view(num_tokens, 2, num_kv_heads, head_dim)
    return batch, q, kv, num_blocks
