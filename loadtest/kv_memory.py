"""KV-cache memory: bytes per token for each KV dtype, and how many concurrent 512-token
sequences one 512 MiB pool holds, paged against a contiguous max-length allocation.

For each KV dtype the engine itself sizes the pool (an `LLMEngine` built with
`kv_cache_memory_bytes=512 MiB`; the pool's pages are only reserved, so this costs no RSS),
then sequences of 512 distinct tokens are admitted through the engine's own `KVCacheManager`
until a block allocation fails: the count is what the scheduler could run at once, not a
formula. The contiguous baseline is what an engine that reserves `max_model_len` tokens per
sequence up front (HF's static cache, a fixed-slot server) fits in the same bytes.

    python -m loadtest.kv_memory [--model smollm2-135m] [--pool-mib 512] [--seq-len 512]
                                 [--out r.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from loadtest.report import emit

# (label, model dtype, kv_cache_dtype): the float caches hold the model's dtype.
KV_DTYPES = (("float32", "float32", "auto"), ("bfloat16", "bfloat16", "auto"),
             ("int8", "bfloat16", "int8"))  # fmt: skip


def admitted(num_blocks: int, block_size: int, seq_len: int) -> int:
    """How many `seq_len`-token sequences the engine's block manager admits into the pool."""
    from engine.kv_cache_manager import KVCacheManager
    from engine.request import Request
    from engine.sampling_params import SamplingParams

    manager = KVCacheManager(num_blocks, block_size, enable_caching=False)
    count = 0
    while True:
        prompt = list(range(count * seq_len, (count + 1) * seq_len))  # no shared prefixes
        req = Request(f"r{count}", prompt, SamplingParams(max_tokens=1))
        if not manager.allocate_slots(req, seq_len):
            return count
        count += 1


def measure(model: str, pool_bytes: int, seq_len: int) -> dict:
    from engine import LLMEngine

    rows = []
    for label, dtype, kv_cache_dtype in KV_DTYPES:
        eng = LLMEngine(model, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                        kv_cache_memory_bytes=pool_bytes)  # fmt: skip
        runner = eng.runner
        block_bytes = runner.kv_cache_bytes // runner.num_kv_blocks
        token_bytes = block_bytes / runner.block_size
        rows.append({
            "kv_dtype": label,
            "bytes_per_token": round(token_bytes, 1),
            "num_blocks": runner.num_kv_blocks,
            "pool_tokens": runner.num_kv_blocks * runner.block_size,
            "paged_sequences": admitted(runner.num_kv_blocks, runner.block_size, seq_len),
            "contiguous_sequences": int(pool_bytes // (runner.max_model_len * token_bytes)),
            "max_model_len": runner.max_model_len,
        })  # fmt: skip
        del eng
    return {"model": model, "pool_mib": pool_bytes / 2**20, "seq_len": seq_len, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--pool-mib", type=int, default=512)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    doc = measure(args.model, args.pool_mib * 2**20, args.seq_len)
    print(f"{'KV dtype':9} {'bytes/token':>11} {'pool tokens':>11} "
          f"{args.seq_len}-token seqs: {'paged':>6} {'contiguous':>10}", file=sys.stderr)  # fmt: skip
    for r in doc["rows"]:
        print(f"{r['kv_dtype']:9} {r['bytes_per_token']:>11.0f} {r['pool_tokens']:>11} "
              f"{'':17} {r['paged_sequences']:>6} {r['contiguous_sequences']:>10} "
              f"(max_model_len {r['max_model_len']})", file=sys.stderr)  # fmt: skip
    emit(doc, args.out, None, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
