"""Extend attention (a prefill chunk after cached tokens): the C++ kernel that reads the cache
in place against the torch reference (gather the context out of the block pool, then SDPA).

Not a test: a measurement that sets `EXTEND_MAX_TOKENS` in engine/kernels/cpu/paged_attention.py.
SmolLM2-135M shapes (9 heads, 3 KV heads, head_dim 64, block 16); the two sides alternate for
`--rounds` rounds per cell and the ratio of medians (reference time / kernel time, > 1: the
kernel is faster) is printed for each (cached prefix, new tokens) cell. Times are the process's
CPU time on one thread (`--threads 1`, the default), so that other tenants of a shared machine
do not count; both sides parallelise the same way over threads.

    python -m loadtest.bench_extend_attention --dtype bf16 --rounds 9
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

PREFIXES = (16, 128, 512, 2048)
NEW_TOKENS = (2, 8, 32, 128, 512)


def cell(extension, prefix: int, new: int, dtype, rounds: int) -> dict:
    import torch

    from engine.kernels.attention_types import PrefillChunk
    from engine.kernels.cpu import paged_attention
    from engine.layers.attention import TorchPagedAttention

    num_heads, num_kv_heads, head_dim, block_size = 9, 3, 64, 16
    num_ctx = prefix + new
    num_blocks = -(-num_ctx // block_size)
    pool = 4 * num_blocks + 8
    gen = torch.Generator().manual_seed(prefix * 1000 + new)
    kv_cache = torch.randn(pool, block_size, 2, num_kv_heads, head_dim, generator=gen).to(dtype)
    block_ids = torch.randperm(pool, generator=gen)[:num_blocks]
    qkv = torch.randn(new, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
    q = qkv[:, :num_heads]
    allowed = torch.arange(num_ctx)[None, :] <= torch.arange(prefix, num_ctx)[:, None]
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
    chunk = PrefillChunk(0, new, prefix, block_ids, mask)
    reference = TorchPagedAttention()
    out = torch.empty(q.shape, dtype=dtype)

    def run_reference():
        reference._prefill(q, None, kv_cache, chunk)

    def run_kernel():
        paged_attention.extend(extension, q, kv_cache, [chunk], out)

    times = {"reference": [], "kernel": []}
    for fn in (run_reference, run_kernel):  # warm-up (buffers, page faults)
        fn()
    for _ in range(rounds):
        for name, fn in (("reference", run_reference), ("kernel", run_kernel)):
            start = time.process_time()
            fn()
            times[name].append(time.process_time() - start)
    reference_ms = statistics.median(times["reference"]) * 1e3
    kernel_ms = statistics.median(times["kernel"]) * 1e3
    return {
        "prefix": prefix, "new_tokens": new, "reference_ms": round(reference_ms, 3),
        "kernel_ms": round(kernel_ms, 3), "ratio": round(reference_ms / kernel_ms, 2),
    }  # fmt: skip


def engine_rounds(
    dtype: str, prefix_len: int, suffix_len: int, num_requests: int, rounds: int
) -> dict:
    """In the engine (SmolLM2, all threads): `num_requests` prompts sharing a cached prefix of
    `prefix_len` tokens, each with its own `suffix_len` tokens, one new token each, so the
    measured steps are prefill chunks after a prefix-cache hit. The extend kernel against
    gather + SDPA for those chunks (the rule switched in the same engine), alternating."""
    from engine import LLMEngine, SamplingParams
    from engine.kernels.cpu import paged_attention

    eng = LLMEngine("smollm2-135m", dtype=dtype)
    prefix = [(37 * i) % 5000 + 100 for i in range(prefix_len)]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def run(tag: str, salt: int) -> float:
        eng.add_request(f"{tag}-fill", prefix + [7], one)  # (re)fills the prefix cache
        while eng.has_unfinished_requests():
            eng.step()
        for i in range(num_requests):
            # Distinct in every run, so only the shared prefix is ever a cache hit.
            suffix = [(salt * 7919 + i * 131 + j * 17) % 5000 + 100 for j in range(suffix_len)]
            eng.add_request(f"{tag}-{i}", prefix + suffix, one)
        start = time.perf_counter()
        while eng.has_unfinished_requests():
            eng.step()
        return time.perf_counter() - start

    real_rule = paged_attention.use_extend_kernel
    sides = {  # (this machine's calibrated limit set aside: each side takes every chunk)
        "kernel": lambda chunk, dtype, limit=None: real_rule(chunk, dtype),
        "reference": lambda chunk, dtype, limit=None: False,
    }
    times: dict[str, list[float]] = {name: [] for name in sides}
    try:
        for index in range(rounds + 1):  # the first round warms both up, and is dropped
            for side, (name, rule) in enumerate(sides.items()):
                paged_attention.use_extend_kernel = rule
                elapsed = run(f"{name}{index}", salt=2 * index + side)
                if index:
                    times[name].append(elapsed)
    finally:
        paged_attention.use_extend_kernel = real_rule
    medians = {name: statistics.median(t) for name, t in times.items()}
    return {"dtype": dtype, "prefix": prefix_len, "suffix": suffix_len,
            "requests": num_requests, "rounds": rounds,
            "seconds": times, "ratio": round(medians["reference"] / medians["kernel"], 3)}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--prefixes", default=",".join(map(str, PREFIXES)))
    parser.add_argument("--new-tokens", default=",".join(map(str, NEW_TOKENS)))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="write the cells here")
    parser.add_argument(
        "--engine", metavar="PREFIX,SUFFIX,REQUESTS",
        help="instead: prefix-cache hits in the engine (all threads), e.g. 512,24,16",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.engine:
        prefix_len, suffix_len, num_requests = (int(x) for x in args.engine.split(","))
        dtype = {"fp32": "float32", "bf16": "bfloat16"}[args.dtype]
        result = engine_rounds(dtype, prefix_len, suffix_len, num_requests, args.rounds)
        print(json.dumps(result, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        return

    import torch

    from engine.kernels.cpu import paged_attention

    torch.set_num_threads(args.threads)
    extension = paged_attention.load()
    if extension is None:
        raise SystemExit("the C++ kernel could not be built here (no compiler)")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    prefixes = [int(x) for x in args.prefixes.split(",")]
    news = [int(x) for x in args.new_tokens.split(",")]
    print(f"{args.dtype}, {torch.get_num_threads()} threads, {args.rounds} alternating rounds; "
          "reference ms / kernel ms (ratio > 1: kernel faster)")  # fmt: skip
    print("prefix \\ new " + "".join(f"{n:>22}" for n in news))
    cells = []
    for prefix in prefixes:
        row = []
        for new in news:
            result = cell(extension, prefix, new, dtype, args.rounds)
            cells.append(result)
            row.append(
                f"{result['reference_ms']:7.2f}/{result['kernel_ms']:7.2f} {result['ratio']:5.2f}"
            )
        print(f"{prefix:>13} " + "".join(f"{r:>22}" for r in row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dtype": args.dtype, "threads": torch.get_num_threads(),
                       "rounds": args.rounds, "cells": cells}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
