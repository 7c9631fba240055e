"""The fused decode step: a Llama-family model's decoder layers, for a step of
decode rows only, as one C++ call with one OpenMP parallel region.

Why: on the default model a decode step is ~650 operator calls from Python, each with its own
parallel region. With OMP_WAIT_POLICY=PASSIVE (the engine's default, engine/openmp.py: spinning
costs 10-40x when the cores are shared) every region wakes the second thread through the
kernel, and on the 2-core Zen 4 VM that was most of a W1 step (one stream: 37 tok/s with
PASSIVE, 89 with libgomp's spinning default on an idle machine). Here the threads are woken
once per step and meet at barriers that spin briefly and then sleep on a futex; where other
work shares the cores and one thread measures faster for steps of a size, those steps run on
one thread (decode_step.cpp's ThreadChoice). Python runs once per step instead of ~25 times
per layer.

The tasks are the kernels the per-operator path calls (quant_gemm's int4/int8 GEMV, fused_ops'
RMSNorm, RoPE and SiLU * up, paged_attention's decode), so the step's bits equal that path's
(tests/engine/kernels/test_decode_step.py). What it takes: Llama/Mistral layers, bf16
activations, int4 or int8 weights on the C++ kernel (no bias) or bf16 weights on our GEMV
(`linear_kernel="gemv"`, bias allowed), the bf16 KV cache or the int8 one with the
C++ attention backend, the fused ops on; decode-only steps of at most `max_rows` rows. Anything
else takes the per-operator path, step by step (`accepts`).

The step's C++ library (engine/kernels/cpu/decode_step.cpp) is built and loaded by
engine/kernels/cpu/decode_step.py, below the layers; this module, which reads the model's layers
to make the step's tasks, sits above them.
"""

from __future__ import annotations

import os
from types import ModuleType

import structlog
import torch

from engine import huge_pages
from engine.kernels.attention_types import AttentionMetadata, Int8KVCache
from engine.kernels.cpu import bf16_gemm, decode_step, fused_ops, paged_attention, quant_gemm
from engine.layers.linear import Linear
from engine.ngram_lookup import NgramLookup
from engine.quant.embedding import HeadEmbedding
from engine.quant.linear import QuantLinear
from engine.quant.primitives import quantize_int4_groupwise, quantize_int8_per_channel

log = structlog.get_logger(__name__)

# Decode rows per fused step: with int4/int8 weights the per-operator path runs the same GEMV
# kernel at any row count; bf16 weights on our GEMV up to bf16_gemm.FUSED_MAX_ROWS (64). Where a
# layer keeps GEMV_MAX_ROWS (16; linear_choice.py `gemv_max_rows`) the per-operator path hands
# bf16 batches of more rows to oneDNN, so between 17 and 64 rows the fused step's bits are our
# kernel's, not that path's (both round to bf16 once).
MAX_ROWS_QUANT = 64

# From this many rows a quantized GEMV's int8 activations are prepared once, the rows shared
# out over the threads, with a barrier after (quant_gemm.cpp's `shares_preparation`); below it
# every thread prepares every row for itself, with none. SmolLM2's W2 step (32 rows, int4):
# the preparation 0.78 -> 0.33 ms a step, W2 1.010-1.025x in one process (loadtest/JOURNAL.md,
# forty-first session).
SHARED_PREPARE_ROWS = 8

# A greedy step of at most this many rows takes a bf16 lm_head's argmax through an int8 screen
# (`HeadScreen`): at one row the bf16 lm_head is a fifth of the weights a step streams (SmolLM2:
# 57 of 269 MB), the screen half of that. With more rows the GEMV is no longer bound by the
# weights' bytes, and the screen's per-row work grows: those steps read the bf16 head.
SCREEN_MAX_ROWS = 4
SCREEN_MIN_SHARE = 0.125  # below this share of a step's weight bytes, a head gets no screen

# Below this many rows, SiLU * up splits each row in column parts, one per thread (fused_ops.cpp's
# for_row_parts): at one row it was one thread's work while its partners waited (a 1B model's
# one-row step: ~0.3 ms a step). 0: whole rows at every size.
SILU_SPLIT_ROWS = 8

# Speculative decoding (`FusedDecode.speculate`): tokens a draft proposes per step. Verified in
# one step of DRAFT_TOKENS + 1 rows, whose bits are each row's one-row step's only while the
# step's GEMVs sum a row the same way at that row count (`FusedDecode.rows_alike`: our bf16
# GEMV's is 3, bf16_gemm.ROWS_ALIKE; no draft where it is lower) and the rows take the screen
# (at most SCREEN_MAX_ROWS).
DRAFT_TOKENS = 2
DRAFT_GROUP_SIZE = 32  # the draft's int4 weights: a scale and minimum per 32 inputs (as Q4_1)
# Proposals from the request's own tokens (engine/ngram_lookup.py), where no draft model applies
# (int4/int8 projections: a draft would be no cheaper) and before the draft where one does (a
# lookup's proposal costs no draft steps: bf16 W1 1.085x, tree against tree): up to this many, fewer
# where the step's GEMVs keep a row's bits at fewer rows (`rows_alike`). Int4 SmolLM2 on the
# 2-core Xeon (one-row step = 1): verifying 2 rows 1.21, 3 rows 1.36, 4 rows 1.55; a token
# 1.19x cheaper in W1's shape, 1.41x in answers that end at EOS (`bench_speculative
# --quantization int4`); 2 proposals or an adaptive count did no better in a simulation.
LOOKUP_TOKENS = 3
# Requests that verify their proposals in one step (`speculate_batch`), at most: each row costs
# a share of a one-row step (int4 SmolLM2, 2-core Xeon: 2 rows 1.08x one row, 4 rows 1.38x,
# 8 rows 2.15x, 16 rows 3.9x), and the more requests share a step, the less a token it saves
# costs. Answers to EOS, 8 chat prompts (`bench_speculative --quantization int4 --together N
# --stop-at-eos`, 6 rounds ABBA): 2 requests 1.41x, 3 1.27x, 4 1.03x (0.60-1.35) the steps
# without; W1's shape (EOS ignored), 2 requests: 1.00x.
BATCH_MAX_REQUESTS = 3


def unsupported_reason(model, kv_dtype: torch.dtype) -> str | None:
    """Why `model` cannot take the fused step (None: it can)."""
    reason = _architecture_reason(model)
    if reason is not None:
        return reason
    if kv_dtype not in (torch.bfloat16, torch.int8):
        return f"KV cache {kv_dtype}"
    for layer in model.model.layers:
        attn = layer.self_attn
        backend = getattr(attn.backend, "name", None)
        if not (backend == "cpu" and isinstance(attn.kv_cache, torch.Tensor)) and not (
            backend == "cpu-int8kv" and isinstance(attn.kv_cache, Int8KVCache)
        ):
            return f"attention backend {backend}"
        for linear in _projections(layer):
            reason = _linear_reason(linear)
            if reason is not None:
                return reason
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if norm.kernels is None:
                return "fused ops off"
    if model.model.norm.kernels is None:
        return "fused ops off"
    return None


def _architecture_reason(model) -> str | None:
    """Why `model`'s classes are not the ones the step runs (None: they are)."""
    from engine.models.llama import (
        LlamaAttention,
        LlamaDecoderLayer,
        LlamaForCausalLM,
        LlamaMLP,
        LlamaModel,
    )

    if not isinstance(model, LlamaForCausalLM) or type(model.model) is not LlamaModel:
        return f"architecture {type(model).__name__}"
    for layer in model.model.layers:
        types = (type(layer), type(layer.self_attn), type(layer.mlp))
        if types != (LlamaDecoderLayer, LlamaAttention, LlamaMLP):
            return "layer types"
    return None


def linears_for_the_step(model, mode: str) -> list:
    """The plain linears the fused step would run (every projection and the lm_head), to be put
    on our GEMV before the step is resolved: [] where `mode` is "off" or the model's classes
    are not the step's.

    Why not by their own calibration (engine/kernels/cpu/linear_choice.py): a linear on our
    GEMV runs inside the step's one parallel region, and the lm_head there brings the screen,
    the n-gram lookup and the draft (`speculate`) with it. One call of one layer cannot weigh
    that. On the 2-core Zen 5 the calibration put SmolLM2's lm_head on oneDNN (our kernel 1.5x
    slower at 64 rows, faster at 1-16), which took the lm_head off the step: with it on the
    step, W1 bf16 1.78x and W2 0.96x, tree against tree (loadtest/JOURNAL.md, fortieth
    session)."""
    if mode == "off" or _architecture_reason(model) is not None:
        return []
    return [linear for linear in _step_linears(model) if isinstance(linear, Linear)]


def _projections(layer) -> tuple:
    """A decoder layer's four projections, in the order the step runs them."""
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def _linear_reason(linear) -> str | None:
    """Why a projection cannot be a task: the int4/int8 C++ GEMV (no bias) or our bf16 GEMV."""
    if isinstance(linear, QuantLinear):
        if linear.cpp is None or linear.scheme not in ("int4", "int8"):
            return f"a {linear.scheme} linear off the C++ kernel"
        if linear.bias is not None or linear.dtype != torch.bfloat16:
            return f"a {linear.scheme} linear with a bias or in {linear.dtype}"
        return None
    if isinstance(linear, Linear) and linear.kernel == "gemv":
        return None
    return f"a linear on the {getattr(linear, 'kernel', type(linear).__name__)} kernel (not gemv)"


class FusedDecode:
    """Buffers for `max_rows` rows and the plan over them, built once for a model whose layers'
    KV caches are attached; `run` for each decode-only step."""

    def __init__(
        self,
        model,
        step_ext: ModuleType,
        max_model_len: int,
        max_rows: int | None = None,
        speculative: bool = False,
    ):
        cfg = model.model.layers[0].self_attn
        hidden = model.model.norm.weight.shape[0]
        heads, kv_heads, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        inter = model.model.layers[0].mlp.intermediate_size
        cache = cfg.kv_cache
        self.block_size = (cache.codes if isinstance(cache, Int8KVCache) else cache).shape[1]
        # As the per-operator decode splits a context: partitions of partition_blocks blocks
        # (fewer in steps of few rows: `_partitions`), as many as the step's block table is
        # wide (it must be the same split: same bits).
        self.partition_blocks = max(1, paged_attention.PARTITION_TOKENS // self.block_size)
        self.max_blocks = -(-max_model_len // self.block_size)
        max_partitions = -(-self.max_blocks // self.partition_blocks)
        if max_rows is None:
            max_rows = min(
                MAX_ROWS_QUANT if isinstance(linear, QuantLinear) else bf16_gemm.FUSED_MAX_ROWS
                for linear in model.modules()
                if isinstance(linear, (QuantLinear, Linear)) and linear is not model.lm_head
            )
        self.max_rows = max_rows
        bf16, i64 = torch.bfloat16, torch.int64
        m = max_rows
        self.residual = torch.zeros(m, hidden, dtype=bf16)
        self.normed = torch.zeros(m, hidden, dtype=bf16)
        self.branch = torch.zeros(m, hidden, dtype=bf16)  # o_proj / down_proj output
        self.qkv = torch.zeros(m, (heads + 2 * kv_heads) * head_dim, dtype=bf16)
        self.attn = torch.zeros(m, heads, head_dim, dtype=bf16)
        self.gate_up = torch.zeros(m, 2 * inter, dtype=bf16)
        self.act = torch.zeros(m, inter, dtype=bf16)
        self.cos = torch.zeros(m, head_dim, dtype=bf16)
        self.sin = torch.zeros(m, head_dim, dtype=bf16)
        self.block_table = torch.zeros(m, self.max_blocks, dtype=i64)
        self.context_lens = torch.ones(m, dtype=i64)
        self.slot_mapping = torch.zeros(m, dtype=i64)
        self.input_ids = torch.zeros(m, dtype=i64)
        # The quantized GEMVs' shared preparation (codes, scales and sums of m rows of the
        # widest input), one GEMV at a time: they run one after another.
        widest = max(
            (q.in_features for q in model.modules() if isinstance(q, QuantLinear)), default=0
        )
        self.gemv_scratch = torch.zeros(m * widest * 3 // 2 + 512, dtype=torch.uint8)
        self.positions = torch.zeros(m, dtype=i64)
        # The step's inputs are written through numpy views of these buffers: no torch
        # dispatch per input (each op cost 15-20 us a step after the weights had streamed
        # through the caches, against ~2.6 us in a loop).
        self._inputs_np = {
            name: getattr(self, name).numpy()
            for name in ("block_table", "context_lens", "slot_mapping", "input_ids", "positions")
        }
        # [num_partitions, blocks per partition, K/V written by the store task (1 in verifying
        # steps: `speculate`), merge multiplier (0 in steps of one partition), greedy multiplier
        # (1 in steps whose rows all take the argmax), the bf16 lm_head (0 in screened steps),
        # the screen (1 in screened steps)]: the plan reads them through pointers; set per step
        # through a numpy view of the same memory.
        scalars = torch.tensor([1, self.partition_blocks, 0, 0, 0, 1, 0], dtype=i64)
        self.num_partitions, self.store_multiplier = scalars[0:3], scalars[2:3]
        self.merge_multiplier, self.greedy_multiplier = scalars[3:4], scalars[4:5]
        self.head_multiplier, self.screen_multiplier = scalars[5:6], scalars[6:7]
        self._step_scalars = scalars.numpy()
        group = heads // kv_heads
        self.kv_heads = kv_heads
        # Partial results of every (row, KV head, partition): room for max_rows rows of long
        # contexts, and for the small steps whose short contexts are split to share the
        # threads (fewer than 4 x threads items: paged_attention.partition_blocks_for).
        threads = max(torch.get_num_threads(), os.cpu_count() or 1)
        self.max_items = max(m * kv_heads * max_partitions, 4 * threads)
        # (The two largest buffers are left unwritten: a step writes every value it reads, and
        # pages no step touches stay off the process's RSS: logits 6 MiB for 64 rows of
        # SmolLM2's vocabulary, of which W2's 32 rows use half; partials 2.3 MiB, mostly for
        # long contexts. The heap's freed pages are handed back after loading, so these are
        # fresh ones.)
        self.partials = torch.empty(self.max_items * group * (head_dim + 2))
        # The lm_head too where it is a GEMV task (int4/int8, or bf16 on our GEMV): the logits
        # of a decode-only step come out of the same call (every decode row samples).
        self.has_lm_head = _linear_reason(model.lm_head) is None
        vocab = model.lm_head.out_features if self.has_lm_head else 0
        self.logits = torch.empty(m, vocab, dtype=bf16)
        # Greedy ids from the same call (`run(greedy=True)`): each row's logits in slices
        # shared by the threads, then a merge; argmax_rows' indices, found while the logits
        # are still in the caches of the threads that wrote them (the sampler's own pass
        # over them cost 0.1-0.25 ms of a ~4 ms W1 step).
        self.argmax_slices = max(1, torch.get_num_threads())
        self.argmax_keys = torch.zeros(m, self.argmax_slices, dtype=torch.int32)
        self.argmax_partial = torch.zeros(m, self.argmax_slices, dtype=i64)
        self.greedy_ids = torch.zeros(m, dtype=i64)
        self._greedy_rows = 0  # rows of the last run whose greedy ids are in greedy_ids
        # A bf16 lm_head's greedy steps of few rows through an int8 screen (`HeadScreen`);
        # `screened_steps`, and the channels they computed exactly, count its use.
        self.screen = (
            HeadScreen(model.lm_head) if self.has_lm_head and _worth_a_screen(model) else None
        )
        self.screen_candidates = torch.zeros(m, dtype=i64)
        self._screened = False  # the last run took the screen (its logits are not all there)
        self.screened_steps = self.screened_channels = 0
        self.model = model
        # Row gathers inside the step where the tables allow (a plain bf16 embedding table, or
        # the int8 lm_head's packed codes a tied embedding is looked up in (engine/quant/
        # embedding.py: 0.35 ms a step from Python); the rotary tables in bf16); else the
        # step's first ops, from Python.
        embed = model.model.embed_tokens
        self.embedding_table = _plain_table(getattr(embed, "weight", None))
        self.embedding_head = _packed_int8_head(embed) if self.embedding_table is None else None
        self.num_embeddings = (
            self.embedding_table.shape[0] if self.embedding_table is not None
            else self.embedding_head.out_features if self.embedding_head is not None
            else None
        )  # fmt: skip
        rope = model.model.rotary_emb
        self.rope_tables = (
            (rope.cos_table, rope.sin_table)
            if _plain_table(rope.cos_table) is not None and _plain_table(rope.sin_table) is not None
            else None
        )
        self.plan = step_ext.Plan(self._tasks(model, heads, kv_heads, head_dim))
        # Speculative decoding verifies proposals as extra rows of one step: as many as the
        # step's GEMVs keep a row's bits for (`rows_alike`).
        self.rows_alike = min(_rows_alike(linear) for linear in _step_linears(model))
        # The draft: the same step on int4 copies of the layers' bf16 projections, the
        # lm_head's screen for its head (`speculate`).
        rows = min(self.rows_alike, max_rows)
        self.draft = (
            DraftWeights(model)
            if speculative and speculation_reason(model, self) is None and rows > DRAFT_TOKENS
            else None
        )
        self.draft_plan = self.draft_task_names = None
        if self.draft is not None:
            names = self.task_names
            self.draft_plan = step_ext.Plan(
                self._tasks(model, heads, kv_heads, head_dim, self.draft)
            )
            self.draft_task_names, self.task_names = self.task_names, names
        # Proposals from the request's own tokens, verified as the draft's are.
        self.lookup_tokens = min(LOOKUP_TOKENS, rows - 1)
        self.lookup = (
            NgramLookup()
            if speculative and lookup_reason(self) is None
            else None
        )
        self.speculative_steps = self.drafted_tokens = self.accepted_tokens = 0
        # `run_decodes`: per row of the block table, whose block ids it holds and how many
        # (None: nothing known, the row is written whole next time).
        self._row_owners: list[tuple[str, int] | None] = [None] * m

    def _tasks(
        self, model, heads: int, kv_heads: int, head_dim: int, draft: DraftWeights | None = None
    ) -> list[tuple]:
        """The plan's tasks; with `draft`, the draft's (`speculate`): the layers' projections
        on the draft's int4 copies, the lm_head's screen alone (its argmax: the draft token)."""
        fo, pa, qg, bg = (
            fused_ops.load(),
            paged_attention.load(),
            quant_gemm.load(),
            bf16_gemm.load(),
        )
        norm_fn, rope_fn, silu_fn = fo.norm_task_fn(), fo.rotary_task_fn(), fo.silu_mul_task_fn()
        gather_fn = fo.gather_task_fn()
        attn_fn, attn_int8_fn, merge_fn = (
            pa.decode_task_fn(),
            pa.decode_task_int8_fn(),
            pa.merge_task_fn(),
        )
        prepare_fn = qg.gemv_prepare_task_fn() if qg is not None else None
        blocks_fn = qg.gemv_blocks_task_fn() if qg is not None else None
        bf16_fn = bg.gemv_task_fn() if bg is not None else None
        rope_view = self.qkv.view(self.max_rows, heads + 2 * kv_heads, head_dim)[
            :, : heads + kv_heads
        ]
        tasks: list[tuple] = []
        self.task_names: list[str] = []  # per task, for the profile's breakdown
        exp_lanes = (fused_ops.lanes() or (8, 0))[1]  # as engine/layers/ops.py passes it
        # Row-wise tasks are split evenly below 8 rows and shared from a counter from 8 on:
        # attention's items cost what their row's context does, and a thread preempted by other
        # work (a worker's loop, a broker) no longer holds its whole share up at the barrier.
        many = decode_step.TASK_DYNAMIC_MANY
        silu_parts = max(1, torch.get_num_threads())  # a row's parts below SILU_SPLIT_ROWS rows

        def norm(norm_module, x, residual):
            args = fo.make_norm_task(
                x, residual, norm_module.weight, self.normed, norm_module.eps, norm_module.lanes
            )
            tasks.append((norm_fn, args, 0, 1, True, None, many))
            self.task_names.append("norm")

        def gemv(name, linear, x, y, multiplier=None):
            if draft is not None:
                codes, scales = draft.weights[id(linear)]
                return quant_gemv(name, x, y, codes, scales, 4, DRAFT_GROUP_SIZE,
                                  linear.out_features, draft.isa, multiplier)  # fmt: skip
            if not isinstance(linear, QuantLinear):  # our bf16 GEMV (the "gemv" layout)
                args, blocks = bg.make_gemv_task(
                    x, y, linear.weight, linear.bias, linear.out_features, linear._isa
                )
                tasks.append((bf16_fn, args, blocks, 0, True, multiplier))
                self.task_names.append(name)
                return args
            bits = 4 if linear.scheme == "int4" else 8
            return quant_gemv(name, x, y, linear.cpp_codes, linear.cpp_scales, bits,
                              linear.quant.group_size if bits == 4 else 0, linear.out_features,
                              linear.cpp_isa, multiplier)  # fmt: skip

        def quant_gemv(name, x, y, codes, scales, bits, group_size, out_features, isa, multiplier):
            args, blocks = qg.make_gemv_task(
                x, y, codes, scales, bits, group_size, out_features, isa,
                self.gemv_scratch, SHARED_PREPARE_ROWS,
            )  # fmt: skip
            # Below SHARED_PREPARE_ROWS rows each thread prepares the activations for itself
            # (no barrier), from it the threads prepare them once, sharing the rows (a
            # barrier); then the threads take the blocks in chunks from a shared counter, at
            # the end in smaller ones, of no fewer than ~64 KiB of weights (decode_step.cpp's
            # run_share).
            every, dynamic = decode_step.TASK_EVERY_THEN_SPLIT, decode_step.TASK_DYNAMIC
            block_bytes = (codes.nbytes + scales.nbytes) // blocks
            least = max(1, -(-decode_step.LEAST_TAKE_BYTES // block_bytes))
            tasks.append((prepare_fn, args, 0, 1, False, multiplier, every, SHARED_PREPARE_ROWS))
            tasks.append((blocks_fn, args, blocks, 0, True, multiplier, dynamic, least))
            self.task_names += ["gemv_prepare", name]
            return args

        gathers = []  # (fn, args): the step's inputs, rows looked up in tables
        if self.embedding_table is not None:
            args = fo.make_gather_task(self.embedding_table, self.input_ids, self.residual)
            gathers.append((gather_fn, args))
        elif self.embedding_head is not None:
            head = self.embedding_head
            args = qg.make_gather_rows_task(
                head.cpp_codes, head.cpp_scales, self.input_ids, self.residual
            )
            gathers.append((qg.gather_rows_task_fn(), args))
        if self.rope_tables is not None:
            for table, out in zip(self.rope_tables, (self.cos, self.sin), strict=True):
                gathers.append((gather_fn, fo.make_gather_task(table, self.positions, out)))
        for i, (fn, args) in enumerate(gathers):
            last = i == len(gathers) - 1  # the gathers read and write nothing of each other's
            tasks.append((fn, args, 0, 1, last))
            self.task_names.append("gather")

        for index, layer in enumerate(model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            if index == 0:  # residual = the embeddings; normed = RMSNorm(residual)
                norm(layer.input_layernorm, self.residual, None)
            else:  # residual += the last MLP output; normed = RMSNorm(residual)
                norm(layer.input_layernorm, self.branch, self.residual)
            gemv("qkv_proj", attn.qkv_proj, self.normed, self.qkv)
            step_args = (
                self.block_table, self.context_lens, self.slot_mapping, self.num_partitions,
                self.partials, self.attn, heads, self.partition_blocks, head_dim**-0.5,
            )  # fmt: skip
            if isinstance(attn.kv_cache, Int8KVCache):  # new rows quantized as they are written
                cache = attn.kv_cache
                decode_args = pa.make_decode_task_int8(
                    self.qkv, cache.codes, cache.scales, *step_args
                )
                decode_fn, store_fn = attn_int8_fn, pa.store_task_int8_fn()
            else:
                decode_args = pa.make_decode_task(self.qkv, attn.kv_cache, *step_args)
                decode_fn, store_fn = attn_fn, pa.store_task_fn()
            rotary = fo.make_rotary_task(rope_view, self.cos, self.sin)
            tasks.append((rope_fn, rotary, 0, 1, True, None, many))
            self.task_names.append("rotary")
            # (a verifying step's K and V, before any row attends to them: skipped elsewhere)
            tasks.append((store_fn, decode_args, 0, kv_heads, True, self.store_multiplier))
            self.task_names.append("kv_store")
            tasks.append((decode_fn, decode_args, 0, kv_heads, True, self.num_partitions, many))
            # (skipped, with its barrier, in steps of one partition: the decode wrote the output)
            tasks.append((merge_fn, decode_args, 0, kv_heads, True, self.merge_multiplier, many))
            self.task_names += ["attention", "attention_merge"]
            gemv("o_proj", attn.o_proj, self.attn.view(self.max_rows, -1), self.branch)
            norm(layer.post_attention_layernorm, self.branch, self.residual)
            gemv("gate_up_proj", mlp.gate_up_proj, self.normed, self.gate_up)
            silu = fo.make_silu_mul_task(self.gate_up, self.act, exp_lanes, silu_parts,
                                         SILU_SPLIT_ROWS)  # fmt: skip
            tasks.append((silu_fn, silu, 0, silu_parts, True, None, many))
            self.task_names.append("silu_mul")
            gemv("down_proj", mlp.down_proj, self.act, self.branch)
        norm(model.model.norm, self.branch, self.residual)
        if draft is not None:  # the screen's logits and their argmax: the draft tokens
            self._screen_tasks(tasks, bg, None)
            self._argmax_tasks(tasks, fo, None)
            return tasks
        if self.has_lm_head:
            head_args = gemv("lm_head", model.lm_head, self.normed, self.logits,
                             self.head_multiplier)  # fmt: skip
            if self.screen is not None:  # screened steps: A into the logits buffer, then ids
                screen = self.screen
                self._screen_tasks(tasks, bg, self.screen_multiplier)
                args = bg.make_screen_task(head_args, self.logits, screen.bounds, screen.rounding,
                                           self.greedy_ids, self.screen_candidates)  # fmt: skip
                tasks.append((bg.screen_argmax_task_fn(), args, 0, 1, True, self.screen_multiplier))
                self.task_names.append("lm_head_screen_exact")
            self._argmax_tasks(tasks, fo, self.greedy_multiplier)
        return tasks

    def _screen_tasks(self, tasks: list, bg: ModuleType, multiplier) -> None:
        """The screen's GEMV: its logits (A) into the logits buffer."""
        screen = self.screen
        args, blocks = bg.make_screen_gemv_task(
            self.normed, self.logits, screen.codes, screen.scales, screen.out_features, screen.isa
        )
        tasks.append((bg.screen_gemv_task_fn(), args, blocks, 0, True, multiplier))
        self.task_names.append("lm_head_screen")

    def _argmax_tasks(self, tasks: list, fo: ModuleType, multiplier) -> None:
        """The logits buffer's row-wise argmax into greedy_ids: slices, then their merge."""
        args = fo.make_argmax_task(
            self.logits, self.argmax_keys, self.argmax_partial, self.greedy_ids
        )
        slices = self.argmax_slices
        tasks.append((fo.argmax_parts_task_fn(), args, 0, slices, True, multiplier))
        tasks.append((fo.argmax_merge_task_fn(), args, 0, 1, False, multiplier))
        self.task_names += ["argmax", "argmax_merge"]

    def accepts(self, num_tokens: int, meta: AttentionMetadata) -> bool:
        """Whether this step can run fused: decode rows only, few enough."""
        return (
            not meta.prefills
            and meta.num_decodes == num_tokens
            and 0 < num_tokens <= self.max_rows
            and meta.decode_block_table is not None
            and meta.decode_block_table.shape[1] <= self.max_blocks
            and self._partitions(num_tokens, meta.decode_block_table.shape[1])[0] > 0
        )

    def _partitions(self, rows: int, table_blocks: int) -> tuple[int, int]:
        """(partitions, blocks per partition) of a step's attention, as the per-operator decode
        splits it (paged_attention.partition_blocks_for); (0, 0) if the partials cannot hold
        them (more threads than when the buffers were sized: that step runs per operator)."""
        blocks = paged_attention.partition_blocks_for(
            rows, self.kv_heads, table_blocks, self.block_size, torch.get_num_threads()
        )
        partitions = -(-table_blocks // blocks)
        if rows * self.kv_heads * partitions > self.max_items:
            return 0, 0
        return partitions, blocks

    def forget_rows(self) -> None:
        """What `run_decodes` knows of the table's rows is void: requests left or were
        preempted (their blocks freed, so an id may come back with other blocks)."""
        self._row_owners = [None] * self.max_rows

    def run_decodes(
        self,
        scheduled: list,
        greedy: bool,
        num_kv_blocks: int,
        max_model_len: int,
        screen: bool = False,
    ) -> torch.Tensor | None:
        """A decode-only step (every request one token at `start_position`) written from the
        scheduler's requests straight into the step's inputs, with no flat batch in between:
        each row's token, position, context length and slot, and of its block table only the
        ids the row lacks (a running request's block ids only grow, and `forget_rows` is called
        whenever blocks were freed). The checks are the runner's, on scalars, and the new
        block ids only. Then as `run`. None, with nothing run, if the step does not fit (more
        rows than the buffers, or partials too small for its attention split).

        Why: the step's Python runs after the weights have streamed through the caches, so
        each array operation costs 5-8x its warm time (loadtest/JOURNAL.md, "Python on cold
        caches"); this path does a handful instead of ~25 (prepare_step, then `run`'s copies).
        Every id the table holds was checked when written, and the new token's slot is read
        from the table, so whatever a request's list says, the step writes and reads only
        blocks of the pool."""
        rows = len(scheduled)
        if rows > self.max_rows:
            return None
        width = 0
        for row, request in enumerate(scheduled):
            width = max(width, self._write_row(
                row, request.request_id, request.start_position, request.block_ids,
                request.token_ids[0], num_kv_blocks, max_model_len,
            ))  # fmt: skip
        num_partitions, blocks_per = self._partitions(rows, width)
        if num_partitions == 0:
            return None
        if self.num_embeddings is None:
            self.residual[:rows].copy_(self.model.model.embed_tokens(self.input_ids[:rows]))
        if self.rope_tables is None:
            cos, sin = self.model.model.rotary_emb(self.positions[:rows])
            self.cos[:rows].copy_(cos.view(rows, -1))
            self.sin[:rows].copy_(sin.view(rows, -1))
        return self._run_plan(rows, num_partitions, blocks_per, greedy, screen)

    def _write_row(
        self,
        row: int,
        request_id: str,
        position: int,
        blocks: list[int],
        token: int,
        num_kv_blocks: int,
        max_model_len: int,
    ) -> int:
        """Row `row` of the step's inputs: `token` at `position` of the request whose block ids
        are `blocks` (of the table, only the ids the row lacks: `run_decodes`). Returns the
        blocks the row's context spans."""
        inputs = self._inputs_np
        table, owners, block_size = inputs["block_table"], self._row_owners, self.block_size
        if position < 0:
            raise ValueError(f"request {request_id}: nothing to compute")
        if position >= max_model_len:
            raise ValueError(f"request {request_id}: {position + 1} tokens > max_model_len")
        needed = position // block_size + 1
        if len(blocks) < needed:
            raise ValueError(f"request {request_id}: block_ids do not cover {position + 1} tokens")
        owner = owners[row]
        known = owner[1] if owner is not None and owner[0] == request_id else 0
        if known > needed or (known == needed and table[row, needed - 1] != blocks[needed - 1]):
            known = 0  # not the blocks the row holds (never from our scheduler): all again
        if known < needed:
            new = blocks[known:needed]
            if min(new) < 0 or max(new) >= num_kv_blocks:
                raise ValueError(f"request {request_id}: block id outside the pool")
            table[row, known:needed] = new
            owners[row] = (request_id, needed)
        vocab = self.num_embeddings
        if vocab is not None and not 0 <= token < vocab:
            raise IndexError(f"fused decode step: a token id outside [0, {vocab})")
        if self.rope_tables is not None and position >= self.rope_tables[0].shape[0]:
            raise IndexError(
                f"fused decode step: a position outside [0, {self.rope_tables[0].shape[0]})"
            )
        inputs["input_ids"][row], inputs["positions"][row] = token, position
        inputs["context_lens"][row] = position + 1
        # From the row (every id in it was checked), never from the request's own list.
        inputs["slot_mapping"][row] = table[row, needed - 1] * block_size + position % block_size
        return needed

    def speculate(
        self,
        request,
        num_kv_blocks: int,
        max_model_len: int,
        max_new_tokens: int,
        history: list[int] | None = None,
        sample=None,
    ) -> list[int] | None:
        """A decode of one request, speculatively. Greedy (`sample` None): the draft (the same
        step on int4 copies of the projections, the lm_head's screen as its head) proposes up
        to DRAFT_TOKENS tokens, one draft step each; before it (and where there is no draft), the
        lookup proposes up to `lookup_tokens` from `history`, the request's prompt and output
        tokens so far (engine/ngram_lookup.py), and the draft runs only where it proposes
        nothing. Then one step of the request's token and the proposals as
        consecutive rows computes each row's greedy token exactly (its K and V written first,
        by the store task; the lm_head through its screen where it has one). The first token,
        the proposals that equal the token before them verified, and the verified token after
        the last of those are this step's tokens: 1 to k + 1 of them, at most
        `max_new_tokens`.

        Each row's bits are those of the one-row step at its position: the GEMVs sum a row as
        they do alone at that many rows (`rows_alike`: our bf16 GEMV at 1 to 3 rows,
        bf16_gemm.cpp's `unroll`; quant_gemm's int8-activation path at any), the rows are split in
        the one-row step's attention partitions (the split changes only from one block to the
        next, and drafts stay in the blocks the request holds, which for our scheduler's
        decodes is the current one; rows that would split otherwise are not drafted), and the
        rows of norms, RoPE and SiLU are row-wise. So the tokens are the ones
        one-token steps would give, faster where proposals hold (a verifying step streams the
        weights once for up to 3 tokens; a draft step reads 0.4 of their bytes).

        The K and V rows a draft step and a rejected row wrote lie past the request's
        computed tokens, in its own blocks: the next step writes over them. Drafts stay within
        the blocks the request holds. None, with nothing run, where no token can be drafted
        (the request's last block is full, or its rows would split differently): the caller
        runs a one-token step; also where the lookup has no proposal.

        Sampled (`sample(logits [k + 1, vocab], proposals) -> tokens`, the sampler's `verify`):
        the lookup's proposals only (a draft proposes its argmax), and the step computes the
        rows' logits, each with its one-row step's bits; `sample` draws each row's token as a
        one-token step would, from the request's own random stream, until one differs from the
        proposal after it: the tokens, and the stream, are the one-token steps'."""
        lookup = self.lookup if history is not None else None
        draft = self.draft_plan if sample is None else None
        if draft is None and lookup is None:
            return None
        position, blocks, request_id = request.start_position, request.block_ids, request.request_id
        block_size = self.block_size
        k = min(
            max(DRAFT_TOKENS if draft is not None else 0,
                self.lookup_tokens if lookup is not None else 0),  # fmt: skip
            self._room(request, max_model_len, max_new_tokens),
        )
        split = self._partitions(1, position // block_size + 1)
        while k > 0 and self._partitions(1, (position + k) // block_size + 1) != split:
            k -= 1  # (the split only grows with the context: the last row's says)
        if k <= 0 or split[0] == 0:
            return None
        tokens = [request.token_ids[0]]
        spin = decode_step.SPIN
        self._greedy_rows = 0
        if lookup is not None:
            tokens += self._propose(request, history, min(k, self.lookup_tokens))
        looked_up = len(tokens) > 1
        if looked_up:
            k = len(tokens) - 1
        elif draft is None:
            return None
        else:
            k = min(k, DRAFT_TOKENS)
        for i in range(0 if looked_up else k):  # the draft, a row at a time
            self._write_row(0, request_id, position + i, blocks, tokens[-1], num_kv_blocks,
                            max_model_len)  # fmt: skip
            self._set_step(*split)
            draft.run(1, 0, spin)
            tokens.append(int(self.greedy_ids[0]))
        for j in range(k + 1):  # the verification: all rows in one step
            self._write_row(j, request_id, position + j, blocks, tokens[j], num_kv_blocks,
                            max_model_len)  # fmt: skip
        screened = sample is None and self.screen is not None and k + 1 <= SCREEN_MAX_ROWS
        self._set_step(*split, stored=True, screen=screened,
                       greedy=sample is None and not screened, head=not screened)  # fmt: skip
        self.plan.run(k + 1, 0, spin)
        if sample is None:
            verified = self.greedy_ids[: k + 1].tolist()
            accepted = _num_kept(tokens[1:], verified)
        else:
            verified = sample(self.logits[: k + 1], tokens[1:])
            accepted = len(verified) - 1
        if looked_up:
            lookup.record(request_id, k, accepted)
        self._count_screen(screened, k + 1)
        self.speculative_steps += 1
        self.drafted_tokens += k
        self.accepted_tokens += accepted
        return verified[: accepted + 1]

    def speculate_batch(
        self,
        requests: list,
        num_kv_blocks: int,
        max_model_len: int,
        max_new_tokens: list[int],
        histories: list[list[int]],
        samples: list | None = None,
    ) -> list[list[int]] | None:
        """Decodes of several requests at once, speculatively: each request's token and the
        lookup's proposals from its own `history` as consecutive rows of one step, which
        computes every row's greedy token exactly (K and V written first, by the store task).
        Per request, as `speculate` keeps them: its token, the proposals that equal the token
        before them verified, and the verified token after the last of those (1 to k + 1, at
        most its `max_new_tokens`). A sampled request (its `samples` entry: the sampler's
        `verify`, as `speculate` takes it; None for a greedy one) gets the rows' logits instead,
        and its tokens are drawn row by row as its one-token steps draw them; where any request
        samples, the step computes every row's logits (no screen), as the same requests'
        one-token step does.

        Each row's bits are those the same requests' one-token step (a row each) gives at that
        row's position: the GEMVs sum a row alike at any count up to `rows_alike`, which bounds
        the step's rows (the one-token step's too); the attention takes the one-token step's
        split (that of len(requests) rows over the widest context), and a proposal stops where
        a wider context would change it; norms, RoPE and SiLU are row-wise. So the tokens are
        the ones one-token steps of the same requests give. Proposals stay in the blocks each
        request holds. Up to BATCH_MAX_REQUESTS requests (past them a verifying row costs about
        what a proposal saves), each with room for a proposal at least. None, with nothing
        run, where no request has a proposal."""
        lookup = self.lookup
        n = len(requests)
        if lookup is None or not 2 <= n <= BATCH_MAX_REQUESTS:
            return None
        budget = min(self.rows_alike, self.max_rows) - n  # rows left for proposals
        block_size = self.block_size
        positions = [request.start_position for request in requests]
        split = self._partitions(n, max(p // block_size + 1 for p in positions))
        if budget < n or split[0] == 0:  # room for a proposal a request, at least
            return None
        proposals: list[list[int]] = []
        for request, new, history in zip(requests, max_new_tokens, histories, strict=True):
            k = min(self.lookup_tokens, budget, self._room(request, max_model_len, new))
            proposal = self._propose(request, history, k)
            budget -= len(proposal)
            proposals.append(proposal)
        ends = [p + len(q) for p, q in zip(positions, proposals, strict=True)]
        while any(proposals) and self._partitions(n, max(ends) // block_size + 1) != split:
            widest = ends.index(max(ends))  # (the split only grows with the context)
            proposals[widest].pop()
            ends[widest] -= 1
        rows = n + sum(map(len, proposals))
        if rows == n or rows * self.kv_heads * split[0] > self.max_items:
            return None
        firsts, row = [], 0
        for request, position, proposal in zip(requests, positions, proposals, strict=True):
            firsts.append(row)
            for j, token in enumerate((request.token_ids[0], *proposal)):
                self._write_row(row, request.request_id, position + j, request.block_ids,
                                token, num_kv_blocks, max_model_len)  # fmt: skip
                row += 1
        self._greedy_rows = 0
        samples = samples or [None] * n
        sampled = any(sample is not None for sample in samples)
        screened = not sampled and self.screen is not None and rows <= SCREEN_MAX_ROWS
        self._set_step(*split, stored=True, screen=screened, greedy=not screened,
                       head=not screened)  # fmt: skip
        self.plan.run(rows, 0, decode_step.SPIN)
        verified = self.greedy_ids[:rows].tolist()
        tokens = []
        for request, first, proposal, sample in zip(
            requests, firsts, proposals, samples, strict=True
        ):
            k = len(proposal)
            if sample is None:
                accepted = _num_kept(proposal, verified[first : first + k])
                kept = verified[first : first + accepted + 1]
            else:
                kept = sample(self.logits[first : first + k + 1], proposal)
            accepted = len(kept) - 1
            if k:
                lookup.record(request.request_id, k, accepted)
            self.drafted_tokens += k
            self.accepted_tokens += accepted
            tokens.append(kept)
        self._count_screen(screened, rows)
        self.speculative_steps += 1
        return tokens

    def _room(self, request, max_model_len: int, max_new_tokens: int) -> int:
        """Rows a verifying step may add after the request's token: within the blocks it holds,
        the model's context and its `max_new_tokens`."""
        position = request.start_position
        return min(
            len(request.block_ids) * self.block_size - position - 1,
            max_model_len - position - 1,
            max_new_tokens - 1,
        )

    def _propose(self, request, history: list[int], k: int) -> list[int]:
        """The lookup's proposals (up to k) after `history`, the request's tokens so far."""
        if history[-1] != request.token_ids[0]:
            raise ValueError(
                f"request {request.request_id}: the history does not end in its token"
            )
        return self.lookup.propose(request.request_id, history, k)

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        greedy: bool = False,
    ):
        """input_ids, positions [rows] -> final hidden states [rows, hidden] (a view of a
        buffer that the next step overwrites). With `greedy` (every row takes the argmax of
        its logits as they are) the step also finds the rows' greedy ids (`greedy_ids_of`)."""
        rows = input_ids.shape[0]
        inputs = self._inputs_np
        ids, pos = input_ids.numpy(), positions.numpy()
        if self.num_embeddings is not None:
            _check_indices(ids, self.num_embeddings, "token id")
            inputs["input_ids"][:rows] = ids
        else:
            self.residual[:rows].copy_(self.model.model.embed_tokens(input_ids))
        if self.rope_tables is not None:
            _check_indices(pos, self.rope_tables[0].shape[0], "position")
            inputs["positions"][:rows] = pos
        else:
            cos, sin = self.model.model.rotary_emb(positions)
            self.cos[:rows].copy_(cos.view(rows, -1))
            self.sin[:rows].copy_(sin.view(rows, -1))
        table = meta.decode_block_table.numpy()
        inputs["block_table"][:rows, : table.shape[1]] = table
        self.forget_rows()  # rows written whole: what run_decodes knew of them is void
        inputs["context_lens"][:rows] = meta.decode_context_lens.numpy()
        inputs["slot_mapping"][:rows] = meta.slot_mapping.numpy()
        return self._run_plan(rows, *self._partitions(rows, table.shape[1]), greedy)

    def _run_plan(
        self, rows: int, num_partitions: int, blocks: int, greedy: bool, screen: bool = False
    ) -> torch.Tensor:
        """The plan over inputs already in the buffers: [rows, hidden] final hidden states
        (and, with `greedy` where the step runs the lm_head, the rows' greedy ids). `screen`:
        the caller needs the greedy ids only, not the logits (the step may then take the
        lm_head's screen, `HeadScreen`)."""
        greedy = greedy and self.has_lm_head
        screened = greedy and screen and self.screen is not None and rows <= SCREEN_MAX_ROWS
        self._set_step(num_partitions, blocks, greedy=greedy and not screened,
                       head=not screened, screen=screened)  # fmt: skip
        self._greedy_rows = 0
        self.plan.run(rows, 0, decode_step.SPIN)
        self._greedy_rows = rows if greedy else 0
        self._count_screen(screened, rows)
        return self.normed[:rows]

    def _count_screen(self, screened: bool, rows: int) -> None:
        """Whether the run of `rows` rows just done took the lm_head's screen, and its counts."""
        self._screened = screened
        if screened:
            self.screened_steps += 1
            self.screened_channels += int(self.screen_candidates[:rows].sum())

    def _set_step(
        self,
        num_partitions: int,
        blocks: int,
        *,
        stored: bool = False,
        greedy: bool = False,
        head: bool = False,
        screen: bool = False,
    ) -> None:
        """The scalars the plans read for the next run: the attention's split (its merge runs
        when there is more than one partition), whether the store task writes the rows' K/V
        (`stored`), and which of the greedy argmax, the bf16 lm_head and its screen run."""
        self._step_scalars[:] = (
            num_partitions, blocks, int(stored), int(num_partitions > 1), int(greedy), int(head),
            int(screen),
        )  # fmt: skip

    def _is_step(self, hidden: torch.Tensor, rows: torch.Tensor) -> bool:
        """Whether `hidden` is this step's output, with the lm_head's results in the step, and
        `rows` are all of its rows in order (a decode-only step samples every row)."""
        if not self.has_lm_head or hidden.data_ptr() != self.normed.data_ptr():
            return False
        # The rows of a decode-only step are one per request, in order, and sampling rows are
        # a subset of them in that order: as many as the step has means every row.
        return rows.shape[0] == hidden.shape[0]

    def logits_of(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor | None:
        """The step's logits [rows, vocab] if `hidden` is this step's output and `rows` are all
        of its rows in order, and the step computed them all (not screened); else None. A view
        of a buffer the next step overwrites: the sampler reads it within the step."""
        if self._screened or not self._is_step(hidden, rows):
            return None
        return self.logits[: hidden.shape[0]]

    def screened(self, hidden: torch.Tensor, rows: torch.Tensor) -> bool:
        """Whether the step whose output `hidden` is took the lm_head's screen: its greedy ids
        are found, its logits are not there."""
        return self._screened and self._is_step(hidden, rows)

    def greedy_ids_of(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor | None:
        """The greedy ids [rows] of the step whose output `hidden` is, where it found them
        (`run(greedy=True)`) for all of `rows`; else None. A view of a buffer the next step
        overwrites."""
        if not self._is_step(hidden, rows) or self._greedy_rows != hidden.shape[0]:
            return None
        return self.greedy_ids[: hidden.shape[0]]


class HeadScreen:
    """An int8 copy of a bf16 lm_head that rules out the channels that cannot be a greedy
    step's argmax (bf16_gemm.cpp's `screen_argmax_task`): per output channel j, scale
    s_j = max|W_j| / 127 and codes round(W_j / s_j). Its GEMV (bf16_gemm.cpp's
    `screen_gemv_task`) multiplies the codes by the activations rounded to integers of up to
    15 bits, d = max|x| / Q per row, in exact integer sums. Each channel's screen logit is then
    within b_j |x|_1 + c_j d of the exact one: b_j the channel's largest weight error (measured
    in float64 against what its codes and scale stand for, at most s_j / 2) plus room for fp32
    sums, c_j = 0.51 s_j sum_k |q_jk| the activations' rounding. The channels it cannot rule
    out are computed exactly from the bf16 weight, by the same kernel calls as the full GEMV:
    the ids are the full logits' argmax, bit for bit (tests/engine/kernels/test_decode_step.py).
    SmolLM2 at W1: ~95 of 49152 channels computed exactly a step. An int4 copy (a quarter of
    the head's bytes) ruled out none there: its error times the final hidden state's |x|_1
    exceeds the logits' spread. Nor do int8 activations with a scale per 32 inputs (the VNNI
    GEMV's): they put the final hidden state's outliers into the bound, and 88% of the channels
    were left to compute exactly. Integer activations of 15 bits widen the bound little against
    exact fp32 ones (SmolLM2, 3 prompts, 63 greedy steps of 3 rows: 31.2 channels computed
    exactly per row and step against 30.2, the same tokens), and their GEMV streams at the
    memory's pace where the fp32 one was bound by its conversions."""

    ROWS_PER_CHUNK = 4096  # quantized this many rows at a time (a float copy of the whole
    # head would be 113 MiB at load)
    ROUNDING = 0.51  # |x_k - d r_k| <= 0.51 d: 0.5 for the integer, 0.01 for x_k / d's rounding

    def __init__(self, head: Linear):
        out_features, in_features = head.out_features, head.in_features
        weight = bf16_gemm.unpack(head.weight, out_features, in_features)
        codes = torch.empty(out_features, in_features, dtype=torch.int8)
        scales = torch.empty(out_features, dtype=torch.float32)
        bounds = torch.empty(out_features, dtype=torch.float64)
        rounding = torch.empty(out_features, dtype=torch.float64)
        for start in range(0, out_features, self.ROWS_PER_CHUNK):
            rows = slice(start, start + self.ROWS_PER_CHUNK)
            q, scale = quantize_int8_per_channel(weight[rows])
            codes[rows], scales[rows] = q, scale
            # (The bound is measured on the codes and scales as they came out, so it holds
            # whatever the quantizer's rounding.)
            stands_for = q.double() * scale.double()[:, None]
            error = (weight[rows].double() - stands_for).abs().amax(dim=1)
            # 4 K 2^-24 128 s_j: the two GEMVs' fp32 sums, each within K 2^-24 of the sum of its
            # terms' magnitudes (at most 128 s_j |x|_1): twice what they need.
            slack = 4 * in_features * 2.0**-24 * 128 * scale.double()
            bounds[rows] = (error + slack) * (1 + 1e-6)
            rounding[rows] = self.ROUNDING * scale.double() * q.double().abs().sum(dim=1)
        del weight
        # Streamed whole every screened step, as the quantized linears' codes: in huge pages
        # where the OS offers them.
        self.codes = huge_pages.adopt(bf16_gemm.pack_screen(codes))
        padded = torch.zeros(self.codes.shape[0] * bf16_gemm.BLOCK, dtype=torch.float32)
        padded[:out_features] = scales
        self.scales = huge_pages.adopt(padded)
        self.bounds = bounds.float()
        self.rounding = (rounding * (1 + 1e-6)).float()
        self.out_features = out_features
        self.isa = bf16_gemm.screen_isa_code()


class DraftWeights:
    """The speculative draft's weights (`FusedDecode.speculate`): every bf16 projection of the
    layers as int4 codes for quant_gemm's GEMV (a scale and minimum per DRAFT_GROUP_SIZE
    inputs; a bias left out: a draft only proposes). SmolLM2-135M: 66 MB beside the 212 MB of
    bf16 layers; the draft's head is the lm_head's int8 screen, already there. Its greedy tokens
    equal the bf16 model's 94.8% of the time there (loadtest/bench_draft_acceptance.py)."""

    def __init__(self, model):
        self.isa = quant_gemm.isa_code(quant_gemm.best_isa(True))
        self.weights: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for layer in model.model.layers:
            for linear in _projections(layer):
                weight = bf16_gemm.unpack(linear.weight, linear.out_features, linear.in_features)
                codes, scale, minimum = quantize_int4_groupwise(weight, DRAFT_GROUP_SIZE)
                packed, scale_min = quant_gemm.pack_int4(codes, scale, minimum)
                self.weights[id(linear)] = (huge_pages.adopt(packed), huge_pages.adopt(scale_min))
        self.num_bytes = sum(c.nbytes + s.nbytes for c, s in self.weights.values())


def _num_kept(proposals: list[int], verified: list[int]) -> int:
    """How many of `proposals`, from the first, equal the greedy token verified in the row
    before each (`verified[i]` for proposal i): those a verifying step keeps."""
    kept = 0
    while kept < len(proposals) and proposals[kept] == verified[kept]:
        kept += 1
    return kept


def speculation_reason(model, fused: FusedDecode) -> str | None:
    """Why the fused step `fused` of `model` cannot decode speculatively (None: it can): the
    draft stands in for bf16 projections on our GEMV, its head is the lm_head's screen, and its
    step gathers its inputs itself."""
    if fused.screen is None:
        return "no lm_head screen"
    if quant_gemm.load() is None:
        return "no quant_gemm library (the draft's GEMV)"
    if fused.num_embeddings is None or fused.rope_tables is None:
        return "embedding or rotary tables the step cannot gather"
    for layer in model.model.layers:
        for linear in _projections(layer):
            if isinstance(linear, QuantLinear):
                return "quantized projections"
            if linear.in_features % DRAFT_GROUP_SIZE:
                return f"in_features {linear.in_features} not a multiple of {DRAFT_GROUP_SIZE}"
    return None


def lookup_reason(fused: FusedDecode) -> str | None:
    """Why the fused step `fused` cannot verify the lookup's proposals (None: it can)."""
    if not fused.has_lm_head:
        return "an lm_head off the step"
    if fused.num_embeddings is None or fused.rope_tables is None:
        return "embedding or rotary tables the step cannot gather"
    if fused.lookup_tokens < 1:
        return f"GEMVs that keep a row's bits at {fused.rows_alike} row(s) only"
    return None


def _step_linears(model) -> list:
    """The linears the fused step runs: every layer's projections and the lm_head."""
    linears = [linear for layer in model.model.layers for linear in _projections(layer)]
    return [*linears, model.lm_head]


def _rows_alike(linear) -> int:
    """The most rows the step's GEMV of `linear` may run while each row keeps its one-row bits."""
    if isinstance(linear, QuantLinear) and linear.cpp is not None:
        return quant_gemm.rows_alike(linear.cpp_isa, linear.in_features)
    if isinstance(linear, Linear) and linear.kernel == "gemv":
        return bf16_gemm.ROWS_ALIKE
    return 1


def _worth_a_screen(model) -> bool:
    """Whether a bf16 lm_head is worth its int8 screen: at least SCREEN_MIN_SHARE of the weight
    bytes a one-row step streams (SmolLM2-135M: 0.21; a 1B Llama's shapes: 0.08, where the
    screen's memory, half the head's, would buy 4% of a step)."""
    head = model.lm_head
    if isinstance(head, QuantLinear) or not isinstance(head, Linear):
        return False
    total = sum(
        module.in_features * module.out_features * (1 if isinstance(module, QuantLinear) else 2)
        for module in model.modules()
        if isinstance(module, (Linear, QuantLinear))
    )
    return 2 * head.in_features * head.out_features >= SCREEN_MIN_SHARE * total


def _packed_int8_head(embed) -> QuantLinear | None:
    """The int8 lm_head a tied embedding is looked up in, if the step can dequantize its rows
    itself (its codes in the C++ kernel's packed layout)."""
    if not isinstance(embed, HeadEmbedding) or embed.dtype != torch.bfloat16:
        return None
    head = embed.head[0]
    if head.scheme != "int8" or head.cpp is None or getattr(head, "cpp_codes", None) is None:
        return None
    codes = head.cpp_codes
    if codes.dtype != torch.int8 or codes.dim() != 3 or codes.shape[2] != quant_gemm.BLOCK:
        return None
    return head


def _plain_table(t: torch.Tensor | None) -> torch.Tensor | None:
    """`t` if the step can gather its rows itself: a bf16 [n, width] CPU table, rows dense."""
    if t is None or t.dtype != torch.bfloat16 or t.dim() != 2 or t.device.type != "cpu":
        return None
    return t if t.stride(1) == 1 else None


def _check_indices(values, size: int, what: str) -> None:
    """The step's gathers read rows `values` of a table of `size` rows: refuse any outside it
    before the step runs (index_select raises; a task cannot)."""
    if values.min() < 0 or values.max() >= size:
        raise IndexError(f"fused decode step: a {what} outside [0, {size})")


class StepForward:
    """The model's forward with the fused step taken where it applies."""

    def __init__(self, model, fused: FusedDecode):
        self.model, self.fused = model, fused

    def __call__(
        self, input_ids, positions, meta: AttentionMetadata, greedy: bool = False
    ) -> torch.Tensor:
        """`greedy`: every row of a decode-only step takes its argmax (the fused step finds
        the ids: `greedy_ids_for`)."""
        if self.fused.accepts(input_ids.shape[0], meta):
            return self.fused.run(input_ids, positions, meta, greedy)
        return self.model(input_ids, positions, meta)

    def run_decodes(
        self,
        scheduled: list,
        greedy: bool,
        num_kv_blocks: int,
        max_model_len: int,
        screen: bool = False,
    ) -> torch.Tensor | None:
        """A step of one-token sampling decodes straight from the scheduler's requests
        (`FusedDecode.run_decodes`); None, with nothing run, where the step does not fit.
        `screen`: greedy ids are all the caller needs (`logits_for` may then be None)."""
        return self.fused.run_decodes(scheduled, greedy, num_kv_blocks, max_model_len, screen)

    def forget_rows(self) -> None:
        self.fused.forget_rows()

    @property
    def speculates(self) -> bool:
        return self.fused.draft is not None or self.fused.lookup is not None

    def speculate(
        self,
        request,
        num_kv_blocks: int,
        max_model_len: int,
        max_new_tokens: int,
        history: list[int] | None = None,
        sample=None,
    ) -> list[int] | None:
        """`FusedDecode.speculate`: 1 to k + 1 tokens of one request (greedy, or drawn by
        `sample`), or None where nothing can be drafted or proposed (then a one-token step)."""
        return self.fused.speculate(request, num_kv_blocks, max_model_len, max_new_tokens,
                                    history, sample)  # fmt: skip

    def speculate_batch(
        self,
        requests: list,
        num_kv_blocks: int,
        max_model_len: int,
        max_new_tokens: list[int],
        histories: list[list[int]],
        samples: list | None = None,
    ) -> list[list[int]] | None:
        """`FusedDecode.speculate_batch`: 1 to k + 1 tokens of each request (greedy, or drawn
        by its `samples` entry), or None where none has a proposal (then a one-token step)."""
        return self.fused.speculate_batch(requests, num_kv_blocks, max_model_len,
                                          max_new_tokens, histories, samples)  # fmt: skip

    def drop_requests(self, request_ids) -> None:
        """Requests that left: what the lookup kept of them goes."""
        if self.fused.lookup is not None:
            self.fused.lookup.drop(request_ids)

    def step_counters(self) -> tuple[int, int, float]:
        """(fused steps, of which the thread choice ran on one thread, seconds this thread
        waited for the GIL after them) so far."""
        steps, one_thread, gil_wait_ns = self.fused.plan.counters()
        return steps, one_thread, gil_wait_ns / 1e9

    def logits_for(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor | None:
        """Logits of `rows` of `hidden`: the fused step's own where it computed them; None for
        a step that took the lm_head's screen (its caller asked for greedy ids only)."""
        if self.fused.screened(hidden, rows):
            return None
        logits = self.fused.logits_of(hidden, rows)
        if logits is None:
            logits = self.model.compute_logits(hidden.index_select(0, rows))
        return logits

    def greedy_ids_for(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor | None:
        """The greedy ids of `rows` of `hidden` where the fused step found them, else None."""
        return self.fused.greedy_ids_of(hidden, rows)


def resolve(model, mode: str, kv_dtype: torch.dtype, max_model_len: int, speculative: str = "off"):
    """The model's forward for the runner: fused where `mode` ("auto", "on", "off") and the
    model allow, else the model itself. "on" where it cannot apply logs why and falls back.
    `speculative` ("auto", "on", "off"): the fused step's speculative decoding where it applies
    (`FusedDecode.speculate`); "on" where it cannot logs why."""
    if mode == "off":
        return model, "off"
    reason = unsupported_reason(model, kv_dtype)
    step_ext = decode_step.load() if reason is None else None
    if reason is None and step_ext is None:
        reason = "no decode_step library (no compiler)"
    if reason is not None:
        (log.warning if mode == "on" else log.debug)("decode_step.unsupported", reason=reason)
        return model, reason
    fused = FusedDecode(model, step_ext, max_model_len, speculative=speculative != "off")
    if speculative == "on" and fused.draft is None and fused.lookup is None:
        log.warning("decode_step.speculation_unsupported", reason=speculation_reason(model, fused),
                    lookup=lookup_reason(fused))  # fmt: skip
    return StepForward(model, fused), None
