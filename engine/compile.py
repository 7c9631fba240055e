"""The compiled step: torch.compile (Inductor, CPU C++ code generation) of the model forward.

Inductor fuses the elementwise chains between the GEMMs into single loops (residual add +
RMSNorm, RoPE on q/k, SiLU * up, the casts around them) and, with freezing, re-lays the linear
weights out for oneDNN/MKL itself, so the eager packing is skipped when compiling.

Attention (with its KV write) is one registered custom op, `mini_infer::paged_attention`, so the
graph stays whole from embedding to logits. The op takes only tensors (q, kv) and the layer
index; the step's AttentionMetadata, the backend and the per-layer KV caches come from the step
context the runner sets around each call. This keeps the metadata (Python lists of prefill
chunks, a varying number of them) out of the graph, so its guards never change with the batch
composition, and keeps the KV pool out of the graph too (freezing would otherwise treat it as a
constant). The op writes the cache as a side effect the compiler does not see: nothing in the
graph reads the cache, and the op's output feeds the next layer, so it runs once, in order.

The token dimension is dynamic (one graph for every batch size; a size-1 batch gets its own
specialised graph), so a long-running worker stops compiling after the first few steps (a test
runs 300 steps of changing batches and counts no new graph after warm-up).

Measured (SmolLM2 bf16 on the 2-core Zen 4 VM, one process holding both engines, 32 new tokens,
3 alternating rounds, medians): compiled / eager tok/s 1.04 for 1 stream and 0.89 for 16. The
GEMMs, 80% of a decode step, are the same oneDNN calls either way, and the fused elementwise
loops save less than the graph's own overhead here; compiling took 270 s per graph (two graphs)
on the loaded machine (Inductor's on-disk cache under the cache dir makes a restart cheaper).
No win, so `compile="auto"` means off; "on" stays available and tested (same greedy tokens as
eager on tiny fp32 models).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import structlog
import torch

from engine.kernels.attention_types import AttentionMetadata

log = structlog.get_logger(__name__)

@dataclass
class _StepContext:
    backend: object
    meta: AttentionMetadata | None
    kv_caches: list[torch.Tensor]


_context = threading.local()


@contextmanager
def step_context(backend, meta: AttentionMetadata, kv_caches: list[torch.Tensor]):
    """Make `meta` (and the backend and caches) visible to the attention op for one step."""
    previous = getattr(_context, "value", None)
    _context.value = _StepContext(backend, meta, kv_caches)
    try:
        yield
    finally:
        _context.value = previous


@torch.library.custom_op("mini_infer::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, kv: torch.Tensor, layer_index: int) -> torch.Tensor:
    """q [num_tokens, num_heads, head_dim], kv [num_tokens, 2, num_kv_heads, head_dim] ->
    [num_tokens, num_heads, head_dim]; writes kv into the layer's cache first."""
    ctx: _StepContext | None = getattr(_context, "value", None)
    if ctx is None:
        raise RuntimeError("mini_infer::paged_attention called outside a step context")
    out = ctx.backend.forward(q, kv, ctx.kv_caches[layer_index], ctx.meta)
    return out.contiguous()


@paged_attention.register_fake
def _(q: torch.Tensor, kv: torch.Tensor, layer_index: int) -> torch.Tensor:
    return q.new_empty(q.shape)


class LayerAttentionOp:
    """Stands in for a layer's backend inside the compiled graph: calls the custom op with the
    layer's index (the cache and metadata arguments the model passes are not used)."""

    name = "op"

    def __init__(self, layer_index: int):
        self.layer_index = layer_index

    def forward(self, q, kv, kv_cache, meta) -> torch.Tensor:
        return torch.ops.mini_infer.paged_attention(q, kv, self.layer_index)


class CompiledModel:
    """model(input_ids, positions, meta) with the forward compiled; same call as the eager one."""

    def __init__(self, model: torch.nn.Module, backend, kv_caches: list[torch.Tensor]):
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        attention_layers = [m for m in model.modules() if hasattr(m, "kv_cache")]
        for index, layer in enumerate(attention_layers):
            layer.backend = LayerAttentionOp(index)
        # Inductor's on-disk caches (FX graphs, generated C++) under our cache dir: a restarted
        # worker reloads its kernels instead of regenerating them.
        from engine.loader import cache_dir

        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
        self.num_compiles = 0
        self.compile_s = 0.0
        self._compiled: Callable = torch.compile(
            self._forward, dynamic=True, fullgraph=True,
            options={"freezing": True, "cpp_wrapper": False},
        )  # fmt: skip

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions, None)

    def __call__(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        with step_context(self.backend, meta, self.kv_caches):
            start = time.perf_counter()
            frames_before = _num_frames_compiled()
            out = self._compiled(input_ids, positions)
            if _num_frames_compiled() != frames_before:
                elapsed = time.perf_counter() - start
                self.num_compiles += 1
                self.compile_s += elapsed
                log.info(
                    "compile.graph_compiled", num_tokens=int(input_ids.shape[0]),
                    seconds=round(elapsed, 1), num_compiles=self.num_compiles,
                )  # fmt: skip
            return out


def _num_frames_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
