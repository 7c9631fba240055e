"""How long a prefill chunk after cached tokens may be and still take the extend kernel, decided
on the running machine.

Such a chunk (the next chunk of a long prompt, a prefix-cache hit, a resumed request) goes
either to the extend kernel, which reads the cache in place (engine/kernels/cpu/
paged_attention.py), or to the torch reference, which gathers the context out of the block
pool and runs SDPA. Which is faster depends on the CPU and on the chunk's new tokens, and a rule
measured on one CPU was wrong on the other: on the AMD EPYC (2026-12-03) the kernel ran 0.77-1.75x the
reference's speed at every size measured; on the 2-core Xeon (no avx512_bf16), bf16, 2 threads,
1024 cached tokens, it wins with 1-4 new tokens (3.9x at 1) and loses from 16 on (0.25-0.9x;
`bench_extend_attention --threads 2`): a 4096-token prompt's prefill took 1.46x as long with
its later 1024-token chunks on the kernel as on the reference.

The context counts too: after a short prefix the reference's gather and per-chunk SDPA call
cost more than the attention itself. On the AVX2-only Zen 3 (bf16, 2 threads, SmolLM2's 9x3x64
shape), the kernel lost from 16 new tokens after 1024 cached (716 against 632 us) while 31
chunks of 22 new tokens after 32 cached (a burst of chat prompts sharing their template) took
1.4 ms a layer on it against 4.1 on the reference.

So `extend_limit` times both on the model's attention shape (heads, KV heads, head dim, block
size, dtype) after 1024 cached tokens and after 64, for chunks of 1, 4, 16, 64 and 256 new
tokens (rounds alternating, the fastest call of each side compared: engine/kernels/cpu/
calibration.py, as the linear layers are timed), and for each context returns the largest of
those sizes up to which the kernel never lost (`ExtendLimits`): chunks up to it take the kernel,
longer ones the reference (no limit where it won at every size, 0 where it lost at one token);
a chunk after at most SHORT_CONTEXT_MAX cached tokens takes the short context's limit. Cached
per machine (CPU fingerprint, threads, shape) in the calibration directory; a decision taken on
a busy machine is used but not cached.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import structlog
import torch

from engine.kernels.attention_types import PrefillChunk, causal_chunk_mask
from engine.kernels.cpu import calibration, paged_attention
from engine.platform import cpu_info

log = structlog.get_logger(__name__)

CALIBRATION_PREFIX = 1024  # cached tokens before the timed chunks (a long context)
SHORT_PREFIX = 64  # and a short one
SHORT_CONTEXT_MAX = 256  # chunks after at most this many cached tokens take the short limit
CALIBRATION_NEW_TOKENS = (1, 4, 16, 64, 256)
NO_LIMIT = 1 << 30  # the kernel won at every size: any chunk takes it
_ROUNDS = 7
# Bumped when what a cached entry means changes (v2: the reference splits the causal mask in
# two attentions, engine/layers/attention.py `_prefill_split`; v3: a limit per context, and the
# AVX2 build's extend kernel on vector paths).
CALIBRATION_VERSION = 3


@dataclass(frozen=True)
class ExtendLimits:
    """The most new tokens a chunk may have and take the extend kernel: after a long context
    (measured after CALIBRATION_PREFIX cached tokens) and a short one (SHORT_PREFIX)."""

    long: int
    short: int

    def for_context(self, cached: int) -> int:
        return self.short if cached <= SHORT_CONTEXT_MAX else self.long

    def __repr__(self) -> str:  # as the start-up log prints it: NO_LIMIT as "any"
        def name(limit: int) -> str:
            return "any" if limit >= NO_LIMIT else str(limit)

        return f"ExtendLimits(long={name(self.long)}, short={name(self.short)})"


def calibration_file():
    return calibration.cache_dir() / f"extend-{cpu_info().fingerprint}.json"


def _key(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    threads = torch.get_num_threads()
    shape = f"{num_heads}x{num_kv_heads}x{head_dim}:block{block_size}"
    return f"{name}:{shape}:threads{threads}:v{CALIBRATION_VERSION}"


# The torch reference's attention for one chunk: (q, kv_cache, chunk) -> out (the layers'
# TorchPagedAttention._prefill; passed in, as kernels sit below the layers).
Reference = Callable[[torch.Tensor, torch.Tensor, PrefillChunk], torch.Tensor]


def extend_limit(
    kernels: ModuleType, reference: Reference, num_heads: int, num_kv_heads: int,
    head_dim: int, block_size: int, dtype: torch.dtype,
) -> ExtendLimits:  # fmt: skip
    """How many new tokens a chunk after cached tokens may have and take the extend kernel."""
    path = calibration_file()
    key = _key(num_heads, num_kv_heads, head_dim, block_size, dtype)
    cached = calibration.read(path).get(key)
    if isinstance(cached, dict) and all(isinstance(cached.get(k), int) for k in ("limit", "short")):
        return ExtendLimits(cached["limit"], cached["short"])
    busy = calibration.busy_reason()
    shape = (num_heads, num_kv_heads, head_dim, block_size, dtype)
    long = calibrate(kernels, reference, *shape)
    short = calibrate(kernels, reference, *shape, prefix=SHORT_PREFIX)
    result = {"limit": long["limit"], "short": short["limit"], "us": long["us"],
              "us_short": short["us"]}  # fmt: skip
    reason = busy or calibration.busy_reason()
    if reason is None:
        calibration.write(path, {key: result})
        log.info("attention.extend_calibrated", file=str(path), key=key, **result)
    else:
        log.warning("attention.extend_calibration_not_cached", reason=reason, key=key, **result)
    return ExtendLimits(result["limit"], result["short"])


def calibrate(
    kernels: ModuleType, reference: Reference, num_heads: int, num_kv_heads: int,
    head_dim: int, block_size: int, dtype: torch.dtype, prefix: int = CALIBRATION_PREFIX,
) -> dict:  # fmt: skip
    """{"limit": ..., "us": {new tokens: [reference, kernel]}} after `prefix` cached tokens:
    sizes in increasing order until the kernel first loses."""
    gen = torch.Generator().manual_seed(0)
    times = {}
    for new in CALIBRATION_NEW_TOKENS:
        context = prefix + new
        num_blocks = -(-context // block_size)
        kv_cache = torch.randn(num_blocks, block_size, 2, num_kv_heads, head_dim, generator=gen)
        kv_cache = kv_cache.to(dtype)
        q = torch.randn(new, num_heads, head_dim, generator=gen).to(dtype)
        mask = causal_chunk_mask(prefix, new, dtype)
        chunk = PrefillChunk(0, new, prefix, torch.arange(num_blocks), mask, causal=True)
        out = torch.empty(q.shape, dtype=dtype)
        samples = calibration.timed_rounds({
            "reference": lambda q=q, kv_cache=kv_cache, chunk=chunk: reference(q, kv_cache, chunk),
            "kernel": lambda q=q, kv_cache=kv_cache, chunk=chunk, out=out: paged_attention.extend(
                kernels, q, kv_cache, [chunk], out
            ),
        }, _ROUNDS)  # fmt: skip
        times[new] = [round(min(samples[side]), 1) for side in ("reference", "kernel")]
        if times[new][1] > times[new][0]:
            break
    return {"limit": decide(times), "us": times}


def decide(times: dict[int, list[float]]) -> int:
    """The limit from {new tokens: [reference us, kernel us]}: the largest size up to which
    the kernel never lost (ties go to the kernel); NO_LIMIT if it never lost, 0 if it lost at
    the smallest."""
    limit = 0
    for new in sorted(times):
        reference, kernel = times[new]
        if kernel > reference:
            return limit
        limit = new
    return NO_LIMIT
