"""`CudaModelRunner`: the model runner on a CUDA GPU, with the Triton kernels and CUDA graphs.

ModelRunner builds everything on the CPU. This subclass changes only where tensors live and how
a decode step is launched: the weights move to the GPU (`_place_model`) and the KV pool is
allocated there (engine/kv_pool.py: the CPU's sizing rule), the elementwise chains take the
Triton kernels (engine/layers/ops.py), each step's inputs are built on the host as before and
copied over (a few kilobytes), attention "auto" resolves to the Triton backend
(engine/attention_backends.py, device "cuda"), and decode-only steps replay a
captured CUDA graph (engine/cuda_graphs.py) when `use_cuda_graphs`. Graphs are captured in the constructor, so start-up (and the worker's
readiness) includes them; their capture time is logged.

Sampling runs on host copies of the sampled rows' logits ([num_samples, vocab]): the sampler's
per-request generators are CPU generators, and greedy decoding syncs for the token ids anyway.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.cuda_graphs import (
    CudaGraphCapture,
    DecodeGraphs,
    GraphCapture,
    decode_context_lens,
    graph_batch_sizes,
)
from engine.kernels.attention_types import AttentionMetadata
from engine.kv_cache_manager import cdiv
from engine.layers.rotary import RotaryEmbedding
from engine.model_runner import ModelRunner
from engine.scheduler_output import ScheduledRequest
from engine.step_batch import StepBatch


def _to_device(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    def move(t):
        return None if t is None else t.to(device, non_blocking=True)

    if meta.num_decodes and meta.decode_context_lens is None:
        meta.decode_context_lens = decode_context_lens(meta)  # counted on the host
    prefills = [
        dataclasses.replace(c, block_ids=move(c.block_ids), mask=move(c.mask))
        for c in meta.prefills
    ]
    return AttentionMetadata(
        slot_mapping=move(meta.slot_mapping),
        num_decodes=meta.num_decodes,
        decode_block_table=move(meta.decode_block_table),
        decode_mask=move(meta.decode_mask),
        decode_context_lens=move(meta.decode_context_lens),
        prefills=prefills,
    )


class CudaModelRunner(ModelRunner):
    device_kind = "cuda"  # "auto" attention is Triton, even on CPU tensors under its interpreter
    packs_linears = False  # the weights move to the device as they are

    def __init__(
        self,
        model_path: Path,
        config: EngineConfig,
        dtype: torch.dtype | str,
        quantization: str | None = "auto",
        *,
        device: torch.device | str = "cuda",
        use_cuda_graphs: bool = True,
        graph_capture: GraphCapture | None = None,
    ):
        self.device = torch.device(device)
        super().__init__(model_path, config, dtype, quantization)
        self.graphs: DecodeGraphs | None = None
        if use_cuda_graphs:
            if self.attention.name != "triton":
                raise ValueError("CUDA graphs need attention_backend='triton' (or 'auto')")
            self.graphs = DecodeGraphs(
                self.model,
                graph_batch_sizes(config.max_num_seqs),
                cdiv(self.max_model_len, self.block_size),
                self.device,
                graph_capture or CudaGraphCapture(),
            )
            with torch.inference_mode():
                self.graphs.capture_all()

    def _place_model(self) -> None:
        # Called by ModelRunner.__init__ after loading, before the pool is allocated (on
        # self.device, engine/kv_pool.py): move the model; its plain linears were never packed
        # (packs_linears).
        if getattr(self.model, "tie_word_embeddings", False):
            self.model.lm_head.weight = self.model.model.embed_tokens.weight
        self.model.to(self.device)
        for module in self.model.modules():  # the rotary tables are plain attributes
            if isinstance(module, RotaryEmbedding) and module.cos_table is not None:
                module.cos_table = module.cos_table.to(self.device)
                module.sin_table = module.sin_table.to(self.device)

    def _prepare(self, scheduled: list[ScheduledRequest]) -> StepBatch:
        batch = super()._prepare(scheduled)
        return dataclasses.replace(
            batch,
            input_ids=batch.input_ids.to(self.device, non_blocking=True),
            positions=batch.positions.to(self.device, non_blocking=True),
            meta=_to_device(batch.meta, self.device),
            sample_rows=batch.sample_rows.to(self.device, non_blocking=True),
        )

    def _forward_batch(self, batch) -> torch.Tensor:
        hidden = None
        if self.graphs is not None:
            hidden = self.graphs.run(batch.input_ids, batch.positions, batch.meta)
        if hidden is None:
            hidden = self.model(batch.input_ids, batch.positions, batch.meta)
        return hidden

    def _logits(self, hidden: torch.Tensor, batch) -> torch.Tensor:
        return self.model.compute_logits(hidden.index_select(0, batch.sample_rows)).cpu()
