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
import functools
import math
import mmap
import os
import sys
import time
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import numpy as np
import structlog
import torch
from transformers import AutoConfig

from engine import openmp
from engine.attention_backends import attention_backend
from engine.compile import CompiledModel
from engine.config import EngineConfig
from engine.kernels.attention_types import AttentionMetadata, PrefillChunk, decode_mask
from engine.kernels.cpu import decode_step
from engine.kernels.cpu.linear_choice import choose_linear_kernels
from engine.kernels.cpu.paged_attention import compiler
from engine.kv_cache_manager import cdiv
from engine.layers.linear import Linear
from engine.layers.pointwise import use_cpu_ops
from engine.logprobs import StepLogprobs, add_sample_logprobs, prompt_logprobs_for_step
from engine.models import get_model_class
from engine.models.llama import head_dim_of
from engine.platform import cpu_info, trim_heap
from engine.precision import resolve_dtype, resolve_precision  # noqa: F401 (re-exported)
from engine.quant import kv_int8, load_model_weights
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler_output import ScheduledRequest, SchedulerOutput

log = structlog.get_logger(__name__)

MAX_DEFAULT_MODEL_LEN = 8192


def _lazy_zeros(
    shape: tuple[int, ...], dtype: torch.dtype, huge_pages: bool = False
) -> torch.Tensor:
    """Zeros whose memory the OS commits page by page on first write.

    `torch.zeros` writes every byte, so a 512 MiB KV pool costs 512 MiB of RSS before the first
    request. A private anonymous mapping is zero already and its pages count only once a block
    is used: a worker's memory follows its load, while the pool (and so the scheduler's limit)
    keeps its configured size. Zero, not garbage, matters: a decode reads whole blocks, and
    masked-out slots must not hold NaN bit patterns (0 * NaN in the attention sum is NaN).

    Without `huge_pages` the mapping is marked MADV_NOHUGEPAGE: a block is a few KiB in each
    layer's slice ([num_layers, num_kv_blocks, ...]), and with transparent huge pages (numpy
    asks for them on its large allocations) its first write commits 2 MiB in every layer.
    Measured (SmolLM2 int4 + int8 KV, 30 layers): one 43-token request committed 87 MiB of
    the pool, 0.5 MiB without."""
    num_bytes = max(1, math.prod(shape) * dtype.itemsize)
    if not hasattr(mmap, "MAP_PRIVATE"):  # not a Unix: calloc, through numpy
        raw = np.zeros(num_bytes + 64, dtype=np.uint8)
        start = -raw.ctypes.data % 64  # cache-line aligned, like torch's own allocations
        return torch.from_numpy(raw[start : start + num_bytes]).view(dtype).view(shape)
    buffer = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE" if huge_pages else "MADV_NOHUGEPAGE", None)
    if advice is not None:
        buffer.madvise(advice)
    # The tensor holds a reference to `buffer`: the mapping lives (and is unmapped) with it.
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)


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


def _release_load_memory() -> None:
    """Hand back, once, what loading freed: the float checkpoint's tensors read, converted and
    quantized are garbage after load, but with the trim threshold above glibc keeps their
    pages. Measured (SmolLM2 int4 + int8 KV, 2-core Zen 4): RSS 639 -> 588 MiB after load."""
    trim_heap()


@dataclass
class StepBatch:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [num_samples]: row of each sampling request's last token
    sample_requests: list[ScheduledRequest]


@dataclass
class ModelRunnerOutput:
    """What one step of the runner produced."""

    sampled: dict[str, int]  # request id -> the token sampled (requests with needs_sample)
    logprobs: dict[str, StepLogprobs]  # request id -> prompt chunk / sample logprobs, if asked


class ModelRunner:
    device_kind = "cpu"  # the attention backend's device (engine/attention_backends.py)

    def __init__(
        self,
        model_path: Path,
        config: EngineConfig,
        dtype: torch.dtype | str,
        quantization: str | None = "auto",
    ):
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        _keep_freed_memory()
        if not openmp.APPLIED_AT_IMPORT and "OMP_WAIT_POLICY" not in os.environ:
            log.warning(
                "model_runner.openmp_spinning",
                detail="torch was imported before engine: OpenMP threads spin while waiting; "
                "set OMP_WAIT_POLICY=PASSIVE in the environment (see engine/openmp.py)",
            )  # fmt: skip
        self.config = config
        self.hf_config = AutoConfig.from_pretrained(model_path)
        device = getattr(self, "device", torch.device("cpu")).type  # CudaModelRunner sets it
        self.dtype, self.quant = resolve_precision(
            Path(model_path), self.hf_config, dtype, quantization, device
        )
        self.block_size = config.block_size
        model_class = get_model_class(self.hf_config)
        self.max_model_len = self._max_model_len(config, self.hf_config, model_class)
        self.is_compiled = self._should_compile(config.compile)
        if self.is_compiled and not getattr(model_class, "supports_compile", True):
            log.warning("model_runner.compile_unsupported", model=model_class.__name__)
            self.is_compiled = False
        backend = self.attention = attention_backend(
            self.device_kind, config.kv_cache_dtype, config.attention_backend, self.is_compiled
        )
        self.model = model_class(
            self.hf_config, self.dtype, self.max_model_len, backend, quant=self.quant
        ).eval()
        # Quantized layers are packed by load_model_weights (torch's layout too when compiled:
        # the C++ kernel's pybind call cannot be traced); the plain ones here, per shape.
        load_model_weights(
            self.model, Path(model_path), self.quant, keep_torch_layout=self.is_compiled
        )
        # Compiled: Inductor's freezing lays the weights out itself, from plain ones.
        linear_kernel = "plain" if self.is_compiled else config.linear_kernel
        self.linear_kernels = self._pack_linears(linear_kernel)
        _release_load_memory()
        self._allocate_kv_cache()
        self.pointwise_ops = None  # compiled, or not on the CPU: per-call choice by device
        if not self.is_compiled and self.kv_cache.device.type == "cpu":
            self.pointwise_ops = use_cpu_ops(self.model, config.fused_ops)
        self._forward = self.model
        self.fused_decode = None  # why the fused decode step does not apply; None when it does
        if self.pointwise_ops is not None:
            self._forward, self.fused_decode = decode_step.resolve(
                self.model, config.fused_decode, self.kv_cache.dtype, self.max_model_len
            )
        if self.is_compiled:
            self._forward = CompiledModel(self.model, backend, self._layer_caches)
            self._warm_up()
        self.sampler = Sampler()
        log.info(
            "model_runner.ready", model=str(model_path), dtype=str(self.dtype).split(".")[-1],
            max_model_len=self.max_model_len, num_kv_blocks=self.num_kv_blocks,
            kv_cache_bytes=self.kv_cache_bytes, attention_backend=backend.name,
            linear_kernels=self.linear_kernels, compiled=self.is_compiled,
            pointwise_ops=self.pointwise_ops,
            fused_decode=self.fused_decode or "on",
            cpu=cpu_info().model_name,
            cpu_isa=cpu_info().vector_isa,
        )  # fmt: skip

    @staticmethod
    def _should_compile(mode: str) -> bool:
        if mode == "off":
            return False
        if mode == "auto":  # measured: no win on the 2-core Zen 4 (engine/compile.py)
            return False
        if compiler() is None:
            log.warning(
                "model_runner.compile_unavailable", fallback="eager",
                detail="torch.compile needs a C++ compiler (set CXX or install g++)",
            )  # fmt: skip
            return False
        return True

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """Compile before the first request: a 1-token and a 2-token decode step and a prefill
        chunk (the graphs steady state needs), written into block 0, then zeroed again."""
        start = time.perf_counter()
        for num_decodes, prefill_len in ((1, 0), (2, 0), (1, 3)):
            scheduled = [
                ScheduledRequest(f"warm-{i}", [0], 0, [0], False, SamplingParams(), seed=0)
                for i in range(num_decodes)
            ]
            if prefill_len:
                scheduled.append(
                    ScheduledRequest("warm-p", [0] * prefill_len, 0,
                                     [0] * cdiv(prefill_len, self.block_size), False,
                                     SamplingParams(), seed=0)
                )  # fmt: skip
            batch = self._prepare(scheduled)
            self._forward(batch.input_ids, batch.positions, batch.meta)
        self.kv_cache[:, 0].zero_()
        if self.config.kv_cache_dtype == "int8":
            self.kv_cache_scales[:, 0].zero_()
        log.info(
            "model_runner.compiled", seconds=round(time.perf_counter() - start, 1),
            num_graphs=self._forward.num_compiles,
            compile_seconds=round(self._forward.compile_s, 1),  # the rest: running the steps
        )  # fmt: skip

    def _pack_linears(self, requested: str) -> dict[str, int]:
        """Pack the linears whose shape a calibration on this CPU (or `requested`) says should
        be; returns how many layers took each path, for the log."""
        linears = [m for m in self.model.modules() if isinstance(m, Linear)]
        choices = choose_linear_kernels(
            [(m.in_features, m.out_features) for m in linears], self.dtype, requested
        )
        counts = {"plain": 0, "packed": 0, "gemv": 0}
        for module in linears:
            module.pack(choices[(module.in_features, module.out_features)])
            counts[module.kernel] += 1
        return counts

    @staticmethod
    def _max_model_len(config: EngineConfig, hf_config, model_class: type = object) -> int:
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
        implements_window = getattr(model_class, "supports_sliding_window", False)
        if uses_window and max_model_len > window and not implements_window:
            # Within the window, sliding-window attention is full attention: cap instead of
            # implementing the window.
            log.warning("model_runner.max_model_len_capped", sliding_window=window)
            max_model_len = window
        return max_model_len

    def _default_num_kv_blocks(self, bytes_per_block: int) -> int:
        """What the configured sequences can use (max_num_seqs full-length sequences), capped
        by the memory budget: a pool past that is never written. Its pages are committed on
        first write either way (`_lazy_zeros`)."""
        usable = self.config.max_num_seqs * cdiv(self.max_model_len, self.block_size)
        return max(1, min(usable, self.config.kv_cache_memory_bytes // bytes_per_block))

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
        self.num_kv_blocks = self.config.num_kv_blocks or self._default_num_kv_blocks(
            bytes_per_block
        )
        if self.config.kv_cache_dtype == "int8":
            self._allocate_int8_kv_cache(num_layers, num_kv_heads, head_dim, bytes_per_block)
            return
        self.kv_cache = _lazy_zeros(
            (num_layers, self.num_kv_blocks, self.block_size, 2, num_kv_heads, head_dim),
            self.dtype,
            huge_pages=self.config.kv_cache_prefault,  # committed whole anyway
        )
        if self.config.kv_cache_prefault:
            self.kv_cache.fill_(0)  # commits every page now (it is zero already)
        self.kv_cache_bytes = self.kv_cache.numel() * element_bytes
        attention_layers = [m for m in self.model.modules() if hasattr(m, "kv_cache")]
        self._layer_caches = [self.kv_cache[i] for i in range(num_layers)]
        for layer_index, attention in enumerate(attention_layers):
            attention.kv_cache = self._layer_caches[layer_index]

    def _allocate_int8_kv_cache(
        self, num_layers, num_kv_heads, head_dim, bytes_per_block, zeros=None
    ) -> None:
        codes, scales = kv_int8.allocate(
            num_layers, self.num_kv_blocks, self.block_size, num_kv_heads, head_dim,
            zeros or functools.partial(_lazy_zeros, huge_pages=self.config.kv_cache_prefault),
        )  # fmt: skip
        if self.config.kv_cache_prefault:
            codes.fill_(0)
            scales.fill_(0)
        self.kv_cache, self.kv_cache_scales = codes, scales
        self.kv_cache_bytes = self.num_kv_blocks * bytes_per_block
        attention_layers = [m for m in self.model.modules() if hasattr(m, "kv_cache")]
        self._layer_caches = [kv_int8.Int8KVCache(codes[i], scales[i]) for i in range(num_layers)]
        for layer_index, attention in enumerate(attention_layers):
            attention.kv_cache = self._layer_caches[layer_index]

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: the token sampled for every request with needs_sample, and the
        logprobs of the requests that asked for them."""
        requests, logits, step_logprobs = self._run(out)
        if not requests:
            return ModelRunnerOutput({}, step_logprobs)
        token_ids = self.sampler(logits, requests)
        add_sample_logprobs(step_logprobs, logits, requests, token_ids)
        sampled = {r.request_id: t for r, t in zip(requests, token_ids, strict=True)}
        return ModelRunnerOutput(sampled, step_logprobs)

    @torch.inference_mode()
    def compute_logits(self, out: SchedulerOutput) -> dict[str, torch.Tensor]:
        """Run one step exactly like `execute` (K/V are written) but return the float32 logits
        [vocab] of each sampling request instead of sampling. For tests and debugging."""
        requests, logits, _ = self._run(out)
        return {r.request_id: logits[i].float() for i, r in enumerate(requests)}

    def _run(
        self, out: SchedulerOutput
    ) -> tuple[list[ScheduledRequest], torch.Tensor | None, dict[str, StepLogprobs]]:
        """schedule's output -> (requests that sample, their logits on the CPU, the step's
        prompt logprob chunks). Device runners override only `_prepare`, `_forward_batch` and
        `_logits` (copies, graph replay), not this."""
        self.sampler.drop(out.finished_request_ids)
        if not out.scheduled:
            return [], None, {}
        batch = self._prepare(out.scheduled)
        hidden = self._forward_batch(batch)  # [num_tokens, hidden]
        prompt_logprobs = prompt_logprobs_for_step(self.model, hidden, out.scheduled)
        if not batch.sample_requests:
            return [], None, prompt_logprobs
        return batch.sample_requests, self._logits(hidden, batch), prompt_logprobs

    def _forward_batch(self, batch: StepBatch) -> torch.Tensor:
        return self._forward(batch.input_ids, batch.positions, batch.meta)

    def _logits(self, hidden: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """[num_samples, vocab] for the batch's sampling rows (the fused step's own logits where
        it computed them)."""
        logits_for = getattr(self._forward, "logits_for", None)
        if logits_for is not None:
            return logits_for(hidden, batch.sample_rows)
        return self.model.compute_logits(hidden.index_select(0, batch.sample_rows))

    def _prepare(self, scheduled: list[ScheduledRequest]) -> StepBatch:
        for request in scheduled:
            self._check(request)
        return prepare_step(
            scheduled, self.block_size, self.dtype,
            getattr(self.attention, "needs_decode_mask", True),  # a backend that does not say
        )  # fmt: skip

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
    scheduled: list[ScheduledRequest],
    block_size: int,
    dtype: torch.dtype = torch.float32,
    build_decode_mask: bool = True,
) -> StepBatch:
    """Flatten one step's requests into model inputs and attention metadata.

    Single-token requests (decodes) come first so attention can batch them; multi-token chunks
    follow, each a contiguous run of rows. Sampling rows are the last token of each
    `needs_sample` request. Positions, slots and the decode block table are computed with
    array operations over all tokens at once (no Python loop per token), and the decode mask,
    which only the torch reference reads, is built only when asked: for 64 decodes at 512
    context a step's preparation went from 0.51 to 0.22 ms against the per-token version with
    its mask (AMD EPYC Zen 4, CPU time, 21 alternating runs, medians; 0.10 ms both for one
    decode).
    """
    decodes = [r for r in scheduled if len(r.token_ids) == 1]
    prefills = [r for r in scheduled if len(r.token_ids) > 1]
    ordered = decodes + prefills
    num_requests = len(ordered)
    token_counts = np.fromiter(map(len, (r.token_ids for r in ordered)), np.int64, num_requests)
    starts = np.fromiter((r.start_position for r in ordered), np.int64, num_requests)
    block_counts = np.fromiter(map(len, (r.block_ids for r in ordered)), np.int64, num_requests)
    num_tokens = int(token_counts.sum())
    input_ids = np.fromiter(chain.from_iterable(r.token_ids for r in ordered), np.int64, num_tokens)
    flat_blocks = np.fromiter(
        chain.from_iterable(r.block_ids for r in ordered), np.int64, int(block_counts.sum())
    )
    token_ends = np.cumsum(token_counts)  # one past each request's last row
    request_of_token = np.repeat(np.arange(num_requests), token_counts)
    positions = starts[request_of_token] + (
        np.arange(num_tokens) - (token_ends - token_counts)[request_of_token]
    )
    first_block = (np.cumsum(block_counts) - block_counts)[request_of_token]
    slots = flat_blocks[first_block + positions // block_size] * block_size + positions % block_size
    needs_sample = np.fromiter((r.needs_sample for r in ordered), bool, num_requests)
    meta = AttentionMetadata(slot_mapping=torch.from_numpy(slots))
    num_decodes = len(decodes)
    if num_decodes:
        _add_decodes(
            starts[:num_decodes] + 1, block_counts[:num_decodes],
            flat_blocks[: int(block_counts[:num_decodes].sum())], block_size,
            dtype if build_decode_mask else None, meta,
        )  # fmt: skip
    _add_prefills(prefills, block_size, dtype, num_decodes, meta)
    return StepBatch(
        input_ids=torch.from_numpy(input_ids),
        positions=torch.from_numpy(positions),
        meta=meta,
        sample_rows=torch.from_numpy(token_ends[needs_sample] - 1),
        sample_requests=[r for r in ordered if r.needs_sample],
    )


def _additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool (True = may attend) -> 0 / -inf in the model dtype, what SDPA adds to the scores."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))


def _add_decodes(
    context_lens: np.ndarray,  # [num_decodes]
    block_counts: np.ndarray,  # [num_decodes] blocks each request holds
    flat_blocks: np.ndarray,  # their block ids, request after request
    block_size: int,
    mask_dtype: torch.dtype | None,
    meta: AttentionMetadata,
) -> None:
    """The padded block table [num_decodes, max blocks needed] (padding 0: masked out or, for
    the kernel, never read past the context length) and, if `mask_dtype`, the additive mask."""
    num_decodes, max_count = context_lens.shape[0], int(block_counts.max())
    held = np.zeros((num_decodes, max_count), np.int64)  # each row: the request's block ids
    held[np.arange(max_count)[None, :] < block_counts[:, None]] = flat_blocks  # row-major order
    needed = -(-context_lens // block_size)  # <= block_counts (checked by the runner)
    width = int(needed.max())
    table = np.where(np.arange(width)[None, :] < needed[:, None], held[:, :width], 0)
    meta.num_decodes = num_decodes
    meta.decode_block_table = torch.from_numpy(table)
    meta.decode_context_lens = torch.from_numpy(context_lens)
    if mask_dtype is not None:
        meta.decode_mask = decode_mask(meta.decode_context_lens, width * block_size, mask_dtype)


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
