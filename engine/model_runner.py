"""The model runner: the one engine module that builds tensors.

It owns the model, the pre-allocated KV-cache pool and the sampler. Each step it flattens every
scheduled token of every request into one batch (single-token decodes first, then multi-token
prefill chunks), maps positions to cache slots through the block ids the scheduler handed out,
runs the model, computes logits only for rows that sample, and samples. `compute_logits` runs
the same step but returns those logits instead of sampling (the tests compare them with HF's).

KV pool: one tensor [num_layers, num_kv_blocks, block_size, 2, num_kv_heads, head_dim] (K and V
of a slot side by side; zero-filled, so padded reads are finite), each layer's attention holding
a view of its slice.
"""

from __future__ import annotations

import ctypes
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import structlog
import torch
from transformers import AutoConfig

from engine.config import EngineConfig
from engine.kv_cache_manager import cdiv
from engine.layers.attention import AttentionMetadata, PrefillChunk, get_attention_backend
from engine.layers.linear import Linear
from engine.logprobs import StepLogprobs, add_sample_logprobs, prompt_logprobs_for_step
from engine.models import get_model_class
from engine.models.llama import head_dim_of
from engine.quant import QuantConfig, kv_int8, load_model_weights
from engine.sampler import Sampler
from engine.scheduler_output import ScheduledRequest, SchedulerOutput

log = structlog.get_logger(__name__)

MAX_DEFAULT_MODEL_LEN = 8192
_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}  # fmt: skip


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """torch dtype for "float32" | "bfloat16" | "float16" (or a torch dtype); ValueError else."""
    resolved = _DTYPES.get(dtype.lower()) if isinstance(dtype, str) else dtype
    if resolved not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"unsupported dtype {dtype!r}; use float32, bfloat16 or float16")
    return resolved


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros whose memory the OS commits page by page on first write.

    `torch.zeros` writes every byte, so a 512 MiB KV pool costs 512 MiB of RSS before the first
    request. calloc of a large block returns fresh anonymous pages that are already zero, and
    they count only once a block is used: a worker's memory follows its load, while the pool
    (and so the scheduler's limit) keeps its configured size. Zero, not garbage, matters: a
    decode reads whole blocks, and masked-out slots must not hold NaN bit patterns (0 * NaN in
    the attention sum is NaN)."""
    num_bytes = math.prod(shape) * dtype.itemsize
    raw = np.zeros(num_bytes + 64, dtype=np.uint8)  # calloc
    start = -raw.ctypes.data % 64  # cache-line aligned, like torch's own allocations
    return torch.from_numpy(raw[start : start + num_bytes]).view(dtype).view(shape)


def _keep_freed_memory() -> None:
    """Stop glibc from handing each step's multi-megabyte temporaries (logits, gathered K/V,
    prefill activations) back to the OS when freed: re-faulting their pages every step doubled
    fp32 decode attention time (3.1 -> 1.5 ms per layer at 176 context). Process-wide, like
    the tcmalloc/jemalloc preload that CPU inference stacks recommend; RSS stays at its peak."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl): nothing to tune
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 32 << 20)  # glibc's maximum
    libc.mallopt(m_trim_threshold, 1 << 30)


@dataclass
class StepBatch:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [num_samples]: row of each sampling request's last token
    sample_requests: list[ScheduledRequest]


class ModelRunner:
    def __init__(
        self,
        model_path: Path,
        config: EngineConfig,
        dtype: torch.dtype | str,
        quantization: str | None = None,
    ):
        self.quant = QuantConfig.parse(quantization)
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        _keep_freed_memory()
        self.config = config
        self.dtype = resolve_dtype(dtype)
        self.block_size = config.block_size
        self.hf_config = AutoConfig.from_pretrained(model_path)
        model_class = get_model_class(self.hf_config)
        self.max_model_len = self._max_model_len(config, self.hf_config)
        backend = get_attention_backend(config.attention_backend)
        if config.kv_cache_dtype == "int8":
            backend = kv_int8.Int8PagedAttention()
        self.model = model_class(
            self.hf_config, self.dtype, self.max_model_len, backend, quant=self.quant
        ).eval()
        load_model_weights(self.model, Path(model_path), self.quant)
        for module in self.model.modules():
            if isinstance(module, Linear):
                module.pack()
        self._allocate_kv_cache()
        self.sampler = Sampler()
        self.step_logprobs: dict[str, StepLogprobs] = {}
        log.info(
            "model_runner.ready", model=str(model_path), dtype=str(self.dtype).split(".")[-1],
            max_model_len=self.max_model_len, num_kv_blocks=self.num_kv_blocks,
            kv_cache_bytes=self.kv_cache_bytes, attention_backend=backend.name,
        )  # fmt: skip

    @staticmethod
    def _max_model_len(config: EngineConfig, hf_config) -> int:
        max_positions = hf_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > max_positions:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the model's "
                f"max_position_embeddings {max_positions}"
            )
        max_model_len = config.max_model_len or min(max_positions, MAX_DEFAULT_MODEL_LEN)
        window = getattr(hf_config, "sliding_window", None)
        layer_types = getattr(hf_config, "layer_types", None) or []
        uses_window = window is not None and (not layer_types or "sliding_attention" in layer_types)
        if uses_window and max_model_len > window:
            # Within the window, sliding-window attention is full attention: cap instead of
            # implementing the window.
            log.warning("model_runner.max_model_len_capped", sliding_window=window)
            max_model_len = window
        return max_model_len

    def _allocate_kv_cache(self) -> None:
        hf = self.hf_config
        num_layers, num_kv_heads, head_dim = (
            hf.num_hidden_layers,
            hf.num_key_value_heads,
            head_dim_of(hf),
        )
        element_bytes = self.dtype.itemsize
        bytes_per_block = 2 * num_layers * self.block_size * num_kv_heads * head_dim * element_bytes
        if self.config.kv_cache_dtype == "int8":
            bytes_per_block = kv_int8.bytes_per_block(
                num_layers, self.block_size, num_kv_heads, head_dim
            )
        self.num_kv_blocks = self.config.num_kv_blocks or max(
            1, self.config.kv_cache_memory_bytes // bytes_per_block
        )
        if self.config.kv_cache_dtype == "int8":
            self._allocate_int8_kv_cache(num_layers, num_kv_heads, head_dim, bytes_per_block)
            return
        self.kv_cache = _lazy_zeros(
            (num_layers, self.num_kv_blocks, self.block_size, 2, num_kv_heads, head_dim),
            self.dtype,
        )
        if self.config.kv_cache_prefault:
            self.kv_cache.fill_(0)  # commits every page now (it is zero already)
        self.kv_cache_bytes = self.kv_cache.numel() * element_bytes
        attention_layers = [m for m in self.model.modules() if hasattr(m, "kv_cache")]
        for layer_index, attention in enumerate(attention_layers):
            attention.kv_cache = self.kv_cache[layer_index]

    def _allocate_int8_kv_cache(self, num_layers, num_kv_heads, head_dim, bytes_per_block):
        codes, scales = kv_int8.allocate(
            num_layers, self.num_kv_blocks, self.block_size, num_kv_heads, head_dim, _lazy_zeros
        )
        if self.config.kv_cache_prefault:
            codes.fill_(0)
            scales.fill_(0)
        self.kv_cache, self.kv_cache_scales = codes, scales
        self.kv_cache_bytes = self.num_kv_blocks * bytes_per_block
        attention_layers = [m for m in self.model.modules() if hasattr(m, "kv_cache")]
        for layer_index, attention in enumerate(attention_layers):
            attention.kv_cache = kv_int8.Int8KVCache(codes[layer_index], scales[layer_index])

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        """Run one step; return {request_id: sampled token} for every request with needs_sample."""
        requests, logits = self._run(out)
        if not requests:
            return {}
        token_ids = self.sampler(logits, requests)
        add_sample_logprobs(self.step_logprobs, logits, requests, token_ids)
        return {r.request_id: t for r, t in zip(requests, token_ids, strict=True)}

    @torch.inference_mode()
    def compute_logits(self, out: SchedulerOutput) -> dict[str, torch.Tensor]:
        """Run one step exactly like `execute` (K/V are written) but return the float32 logits
        [vocab] of each sampling request instead of sampling. For tests and debugging."""
        requests, logits = self._run(out)
        return {r.request_id: logits[i].float() for i, r in enumerate(requests)}

    def take_logprobs(self) -> dict[str, StepLogprobs]:
        """The last step's logprobs (requests that asked for them), handed over once."""
        step, self.step_logprobs = self.step_logprobs, {}
        return step

    def _run(self, out: SchedulerOutput) -> tuple[list[ScheduledRequest], torch.Tensor | None]:
        self.sampler.drop(out.finished_request_ids)
        self.step_logprobs: dict[str, StepLogprobs] = {}
        if not out.scheduled:
            return [], None
        batch = self._prepare(out.scheduled)
        hidden = self.model(batch.input_ids, batch.positions, batch.meta)  # [num_tokens, hidden]
        self.step_logprobs = prompt_logprobs_for_step(self.model, hidden, out.scheduled)
        if not batch.sample_requests:
            return [], None
        logits = self.model.compute_logits(hidden.index_select(0, batch.sample_rows))
        return batch.sample_requests, logits

    def _prepare(self, scheduled: list[ScheduledRequest]) -> StepBatch:
        for request in scheduled:
            self._check(request)
        return prepare_step(scheduled, self.block_size, self.dtype)

    def _check(self, request: ScheduledRequest) -> None:
        end = request.start_position + len(request.token_ids)
        if not request.token_ids or request.start_position < 0:
            raise ValueError(f"request {request.request_id}: nothing to compute")
        if end > self.max_model_len:
            raise ValueError(f"request {request.request_id}: {end} tokens > max_model_len")
        if len(request.block_ids) * self.block_size < end:
            raise ValueError(f"request {request.request_id}: block_ids do not cover {end} tokens")
        if min(request.block_ids) < 0 or max(request.block_ids) >= self.num_kv_blocks:
            raise ValueError(f"request {request.request_id}: block id outside the pool")


def prepare_step(
    scheduled: list[ScheduledRequest], block_size: int, dtype: torch.dtype = torch.float32
) -> StepBatch:
    """Flatten one step's requests into model inputs and attention metadata.

    Single-token requests (decodes) come first so attention can batch them; multi-token chunks
    follow, each a contiguous run of rows. Sampling rows are the last token of each
    `needs_sample` request.
    """
    decodes = [r for r in scheduled if len(r.token_ids) == 1]
    prefills = [r for r in scheduled if len(r.token_ids) > 1]
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    sample_rows: list[int] = []
    sample_requests: list[ScheduledRequest] = []
    for request in decodes + prefills:
        start, num_tokens = request.start_position, len(request.token_ids)
        input_ids.extend(request.token_ids)
        positions.extend(range(start, start + num_tokens))
        ids = request.block_ids
        slots.extend(
            ids[p // block_size] * block_size + p % block_size
            for p in range(start, start + num_tokens)
        )
        if request.needs_sample:
            sample_rows.append(len(input_ids) - 1)
            sample_requests.append(request)
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.int64))
    _add_decodes(decodes, block_size, dtype, meta)
    _add_prefills(prefills, block_size, dtype, len(decodes), meta)
    return StepBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        meta=meta,
        sample_rows=torch.tensor(sample_rows, dtype=torch.int64),
        sample_requests=sample_requests,
    )


def _additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool (True = may attend) -> 0 / -inf in the model dtype, what SDPA adds to the scores."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))


def _add_decodes(
    decodes: list[ScheduledRequest], block_size: int, dtype: torch.dtype, meta: AttentionMetadata
) -> None:
    if not decodes:
        return
    context_lens = [r.start_position + 1 for r in decodes]
    max_num_blocks = cdiv(max(context_lens), block_size)
    table = []
    for request in decodes:
        ids = request.block_ids[:max_num_blocks]
        table.append(ids + [0] * (max_num_blocks - len(ids)))  # padding: masked out below
    lens = torch.tensor(context_lens, dtype=torch.int64)
    key_positions = torch.arange(max_num_blocks * block_size)
    meta.num_decodes = len(decodes)
    meta.decode_block_table = torch.tensor(table, dtype=torch.int64)
    # [num_decodes, 1, 1, max_ctx]: broadcast over KV heads and grouped query rows.
    meta.decode_mask = _additive_mask(key_positions[None, :] < lens[:, None], dtype)[:, None, None]


def _add_prefills(
    prefills: list[ScheduledRequest],
    block_size: int,
    dtype: torch.dtype,
    token_start: int,
    meta: AttentionMetadata,
) -> None:
    for request in prefills:
        start, num_tokens = request.start_position, len(request.token_ids)
        chunk = PrefillChunk(token_start, num_tokens, start)
        if start > 0:
            num_ctx = start + num_tokens
            chunk.block_ids = torch.tensor(
                request.block_ids[: cdiv(num_ctx, block_size)], dtype=torch.int64
            )
            query_positions = torch.arange(start, num_ctx)
            chunk.mask = _additive_mask(
                torch.arange(num_ctx)[None, :] <= query_positions[:, None], dtype
            )
        meta.prefills.append(chunk)
        token_start += num_tokens
