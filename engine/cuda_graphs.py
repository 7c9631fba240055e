"""CUDA graphs for decode steps: capture once per batch-size bucket, replay every step.

A decode step of a small model is hundreds of tiny kernel launches (SmolLM2: 30 layers x about
a dozen kernels), and at batch sizes up to a few dozen the GPU finishes each faster than Python
launches the next. A captured graph replays them all with one launch. A graph fixes shapes and
addresses, so:

- decode-only steps are graphed, for a set of batch sizes (`graph_batch_sizes`); a step of
  n requests is padded up to the nearest captured size. Padding rows carry slot -1 (the KV
  store skips them) and context length 0 (decode attention writes zeros for them), so they
  touch nothing shared. Steps with a prefill chunk, more requests than the largest bucket, or
  a context wider than the captured block table run eagerly.
- inputs live in static buffers that each step copies into; the block table has the width of
  max_model_len, so the decode kernel's split count (a function of shapes only) is fixed.
- attention must be the Triton backend: it reads context lengths from a tensor and never
  syncs with the host, unlike the torch reference (Python loops over chunks, a mask whose
  width changes every step).

The capture itself sits behind the `GraphCapture` seam: `CudaGraphCapture` on a GPU;
`EagerReplayCapture` (for CPU tests) runs the function again on each "replay", so the
bucketing, padding and fallback logic here is tested without a GPU.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from typing import Protocol

import structlog
import torch

from engine.kernels.attention_types import AttentionMetadata

log = structlog.get_logger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to and including max_num_seqs: padding wastes
    at most 15 rows, and each captured size costs memory and start-up time."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sorted(set(sizes) | {max_num_seqs})


def bucket_for(num_seqs: int, batch_sizes: list[int]) -> int | None:
    """The smallest captured size >= num_seqs; None when none is large enough."""
    i = bisect.bisect_left(batch_sizes, num_seqs)
    return batch_sizes[i] if i < len(batch_sizes) else None


def decode_context_lens(meta: AttentionMetadata) -> torch.Tensor:
    """[num_decodes] context lengths: the runner's, or counted from the additive decode mask
    (0 where a key may be attended)."""
    if meta.decode_context_lens is not None:
        return meta.decode_context_lens
    return (meta.decode_mask.view(meta.num_decodes, -1) == 0).sum(-1)


class GraphCapture(Protocol):
    """The seam: turn `fn` (which reads and writes only static tensors) into a replay."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]: ...


class CudaGraphCapture:
    """Real capture: one warm-up run on a side stream (Triton compiles, the allocator settles),
    then torch.cuda.graph; all graphs share one memory pool (they never run concurrently)."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay


class EagerReplayCapture:
    """Test stand-in for CudaGraphCapture: "capturing" runs fn once and "replaying" runs it
    again, reading the static buffers as a graph would. Counts both."""

    def __init__(self) -> None:
        self.num_captures = 0
        self.num_replays = 0

    def capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        self.num_captures += 1
        fn()

        def replay() -> torch.Tensor:
            self.num_replays += 1
            return fn()

        return replay


Model = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


class DecodeGraphs:
    """Captured decode steps of `model` (input_ids, positions, meta -> hidden) per bucket."""

    def __init__(
        self,
        model: Model,
        batch_sizes: list[int],
        max_num_blocks: int,
        device: torch.device,
        capture: GraphCapture,
    ):
        if not batch_sizes:
            raise ValueError("batch_sizes must not be empty")
        self.model = model
        self.batch_sizes = sorted(batch_sizes)
        self.max_num_blocks = max_num_blocks
        self._capture = capture
        size = self.batch_sizes[-1]
        # Static inputs, [max bucket, ...]; bucket b reads the first b rows.
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(size, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((size,), -1, dtype=torch.int64, device=device)
        self.block_table = torch.zeros(size, max_num_blocks, dtype=torch.int64, device=device)
        self.context_lens = torch.zeros(size, dtype=torch.int64, device=device)
        self._replays: dict[int, Callable[[], torch.Tensor]] = {}
        self.capture_s: float | None = None

    def capture_all(self) -> float:
        """Capture every bucket, largest first (later ones reuse its pool memory); return and
        log the seconds it took."""
        start = time.perf_counter()
        for size in reversed(self.batch_sizes):
            meta = AttentionMetadata(
                slot_mapping=self.slot_mapping[:size],
                num_decodes=size,
                decode_block_table=self.block_table[:size],
                decode_context_lens=self.context_lens[:size],
            )
            ids, positions = self.input_ids[:size], self.positions[:size]
            self._replays[size] = self._capture.capture(
                lambda ids=ids, positions=positions, meta=meta: self.model(ids, positions, meta)
            )
        self.capture_s = time.perf_counter() - start
        log.info(
            "cuda_graphs.captured",
            batch_sizes=self.batch_sizes,
            capture_s=round(self.capture_s, 3),
        )
        return self.capture_s

    def bucket(self, meta: AttentionMetadata) -> int | None:
        """The bucket a step replays in, or None: it runs eagerly."""
        if meta.prefills or not meta.num_decodes or not self._replays:
            return None
        if meta.decode_block_table.shape[1] > self.max_num_blocks:
            return None
        return bucket_for(meta.num_decodes, self.batch_sizes)

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor | None:
        """hidden [num_decodes, hidden] from a replay, or None when the step is not graphable
        (the caller runs it eagerly)."""
        size = self.bucket(meta)
        if size is None:
            return None
        n, width = meta.num_decodes, meta.decode_block_table.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.block_table[:n, :width].copy_(meta.decode_block_table)
        self.block_table[:n, width:].zero_()
        self.context_lens[:n].copy_(decode_context_lens(meta))
        # Padding rows: write nowhere, attend to nothing.
        self.input_ids[n:size].zero_()
        self.positions[n:size].zero_()
        self.slot_mapping[n:size].fill_(-1)
        self.context_lens[n:size].zero_()
        return self._replays[size]()[:n]
