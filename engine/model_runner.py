"""The model runner: the one engine module that builds tensors.

It reads in four parts: load (the model, its weights and kernels), pool (the KV cache,
engine/kv_pool.py), warm-up (compiled graphs) and execute. Each step is schedule's output ->
prepare (the flat batch, engine/step_batch.py) -> run the model -> logits only for rows that
sample -> sample -> `ModelRunnerOutput`. `compute_logits` runs the same step but returns those
logits instead of sampling (the tests compare them with HF's). Process-wide tuning (threads,
malloc, OpenMP) is set in engine/platform.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import torch

from engine import fused_decode, kv_pool
from engine.attention_backends import attention_backend
from engine.compile import CompiledModel
from engine.config import EngineConfig
from engine.kernels.cpu.linear_choice import choose_linears
from engine.kernels.cpu.paged_attention import compiler
from engine.kv_cache_manager import cdiv
from engine.layers.linear import Linear
from engine.layers.ops import build as build_ops
from engine.layers.ops import cpu_ops, use_ops
from engine.logprobs import StepLogprobs, add_sample_logprobs, prompt_logprobs_for_step
from engine.model_config import load_config
from engine.models import get_model_class
from engine.models.llama import head_dim_of
from engine.platform import cpu_info, trim_heap, tune_process
from engine.precision import resolve_precision
from engine.quant import load_model_weights
from engine.quant.embedding import HeadEmbedding, share_head_codes
from engine.sampler import Sampler, takes_argmax
from engine.sampling_params import SamplingParams
from engine.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.step_batch import StepBatch, prepare_step

log = structlog.get_logger(__name__)

MAX_DEFAULT_MODEL_LEN = 8192
# After a step of this many tokens (a large prefill), the next step first hands the heap's free
# pages back (`trim_heap`): glibc keeps freed memory for speed (platform.keep_freed_memory), so a
# burst of prompts left its activations resident while decoding filled the KV pool, both on
# the peak RSS (W2: 17 MiB). Decode steps keep their pages: they re-fault them once after such
# a step, not every step. The fused decode step allocates nothing, so before the first of them
# after steps on the per-operator path the heap is trimmed too, whatever their size (W2 with
# int4 + int8 KV: a second prefill step of 203 tokens left 7.6 MiB resident through decoding;
# malloc_trim costs ~1.4 ms there, once per such run of steps).
TRIM_AFTER_TOKENS = 256


@dataclass
class ModelRunnerOutput:
    """What one step of the runner produced."""

    sampled: dict[str, int]  # request id -> the token sampled (requests with needs_sample)
    logprobs: dict[str, StepLogprobs]  # request id -> prompt chunk / sample logprobs, if asked
    # request id -> the greedy tokens after `sampled`'s that a speculative step verified, in
    # order (each the argmax after the one before it; engine/fused_decode.py `speculate`)
    extra: dict[str, list[int]] = field(default_factory=dict)


class ModelRunner:
    device_kind = "cpu"  # the attention backend's device (engine/attention_backends.py)
    device = torch.device("cpu")  # where the model and the pool live (CudaModelRunner: its GPU)
    packs_linears = True  # the plain linears are packed for this CPU's kernels

    def __init__(
        self,
        model_path: Path,
        config: EngineConfig,
        dtype: torch.dtype | str,
        quantization: str | None = "auto",
    ):
        tune_process(config.num_threads)
        self.config = config
        self._is_trim_due = False  # the last step was large: trim before this one
        self._is_trim_due_fused = False  # a per-operator step ran: trim before a fused one
        self._load(Path(model_path), dtype, quantization)
        self._place_model()
        self._allocate_kv_cache()
        self._choose_step()
        self._calibrate_attention()
        if self.is_compiled:
            self._forward = CompiledModel(self.model, self.attention, self._layer_caches)
            self._warm_up()
        self.sampler = Sampler()
        log.info(
            "model_runner.ready", model=str(model_path), dtype=str(self.dtype).split(".")[-1],
            max_model_len=self.max_model_len, num_kv_blocks=self.num_kv_blocks,
            kv_cache_bytes=self.kv_cache_bytes, attention_backend=self.attention.name,
            extend_limit=getattr(self.attention, "extend_limit", None),
            linear_kernels=self.linear_kernels, compiled=self.is_compiled,
            pointwise_ops=self.pointwise_ops,
            fused_decode=self._fused_decode_state(), embedding=self.embedding,
            cpu=cpu_info().model_name,
            cpu_isa=cpu_info().vector_isa,
        )  # fmt: skip

    def _load(self, model_path: Path, dtype: torch.dtype | str, quantization: str | None) -> None:
        """The model, built for its dtype, quantization and attention backend, with its weights
        in and its linears packed for this CPU."""
        self.hf_config = load_config(model_path)
        device = self.device.type
        self.dtype, self.quant = resolve_precision(
            model_path, self.hf_config, dtype, quantization, device
        )
        self.block_size = self.config.block_size
        model_class = get_model_class(self.hf_config)
        self.max_model_len = self._max_model_len(self.config, self.hf_config, model_class)
        self.is_compiled = self._should_compile(self.config.compile)
        if self.is_compiled and not getattr(model_class, "supports_compile", True):
            log.warning("model_runner.compile_unsupported", model=model_class.__name__)
            self.is_compiled = False
        self.attention = attention_backend(
            self.device_kind, self.config.kv_cache_dtype, self.config.attention_backend,
            self.is_compiled,
        )  # fmt: skip
        self.model = model_class(
            self.hf_config, self.dtype, self.max_model_len, self.attention, quant=self.quant
        ).eval()
        # Quantized layers are packed by load_model_weights (torch's layout too when compiled:
        # the C++ kernel's pybind call cannot be traced); the plain ones here, per shape.
        load_model_weights(
            self.model, model_path, self.quant, keep_torch_layout=self.is_compiled,
            embedding_from_head=self._embedding_from_head(device, fused_decode_known=False),
        )  # fmt: skip
        # Compiled: Inductor's freezing lays the weights out itself, from plain ones. A device
        # runner moves plain weights (packing would calibrate CPU kernels it then undoes).
        packs = self.packs_linears and not self.is_compiled
        linear_kernel = self.config.linear_kernel if packs else "plain"
        self.linear_kernels = self._pack_linears(linear_kernel)
        trim_heap()  # what loading freed: RSS 639 -> 588 MiB (SmolLM2 int4 + int8 KV)

    def _choose_step(self) -> None:
        """How a step runs, once the model sits on its device: the elementwise chains
        (engine/layers/ops.py), the fused decode step (eager CPU only) and the embedding."""
        device = self.kv_cache.device.type
        is_eager_cpu = device == "cpu" and not self.is_compiled
        if is_eager_cpu:
            ops = cpu_ops(self.dtype, self.config.fused_ops)
        else:  # compiled: the torch chains, for Inductor to fuse; a GPU: Triton
            ops = build_ops(device, self.dtype)
        self.pointwise_ops = use_ops(self.model, ops)
        self._forward = self.model
        self.fused_decode = None  # why the fused decode step does not apply; None when it does
        if is_eager_cpu:
            self._forward, self.fused_decode = fused_decode.resolve(
                self.model, self.config.fused_decode, self.kv_cache.dtype, self.max_model_len,
                self.config.speculative_decoding,
            )  # fmt: skip
        # The forward takes `greedy` (and finds the greedy ids itself): the fused step's.
        self._forward_takes_greedy = isinstance(self._forward, fused_decode.StepForward)
        # ... and runs decode-only steps from the requests themselves (`_run_decodes`).
        max_rows = self._forward.fused.max_rows if self._forward_takes_greedy else 0
        self._all_rows = torch.arange(max_rows)
        self.embedding = self._share_embedding()

    def fused_step_counters(self) -> tuple[int, int, float]:
        """(fused decode steps, of which on one thread, seconds waited for the GIL after them) so
        far; (0, 0, 0.0) without the fused step."""
        counters = getattr(self._forward, "step_counters", None)
        return counters() if counters is not None else (0, 0, 0.0)

    def draft_counters(self) -> dict[str, int]:
        """Speculative decoding's tokens drafted and accepted so far (EngineStats' fields)."""
        fused = getattr(self._forward, "fused", None)
        if fused is None:
            return {"num_draft_tokens": 0, "num_draft_accepted": 0}
        return {
            "num_draft_tokens": fused.drafted_tokens,
            "num_draft_accepted": fused.accepted_tokens,
        }

    def _fused_decode_state(self) -> str:
        """For the ready log: "on", or why the fused decode step does not run."""
        if self.kv_cache.device.type != "cpu":
            return f"off: {self.kv_cache.device.type} runs the model's own forward"
        if self.is_compiled:
            return "off: compiled"
        return self.fused_decode or "on"

    def _embedding_from_head(self, device: str, fused_decode_known: bool) -> bool:
        """Whether a tied embedding is looked up in the int8 lm_head's codes, its float table
        freed (engine/quant/embedding.py). Compiled or CUDA runs read the table itself: they
        keep it; so does the fused decode step, which gathers its rows in C++ (with no table it
        looks them up from Python, a few torch ops a step). Before loading (`fused_decode_known`
        False) where the fused step is off or the KV cache is int8 (the setting for memory,
        issue 17's peak RSS at W2): then the table goes while loading, off the load's peak."""
        if self.quant is None or not self.quant.embedding_from_head or self.is_compiled:
            return False
        if fused_decode_known:
            return self.fused_decode is not None
        no_fused_step = self.config.kv_cache_dtype == "int8" or self.config.fused_decode == "off"
        return device == "cpu" and no_fused_step

    def _share_embedding(self) -> str:
        """ "head_codes" where the tied embedding is looked up in the head's codes (shared while
        loading, or now that the fused decode step is known not to apply), else "table"."""
        inner = getattr(self.model, "model", None)
        if isinstance(getattr(inner, "embed_tokens", None), HeadEmbedding):
            return "head_codes"
        if not self._embedding_from_head("cpu", fused_decode_known=True):
            return "table"
        if not share_head_codes(self.model):
            return "table"
        trim_heap()
        return "head_codes"

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
        be, the fused step's on our GEMV (`linears_for_the_step`); returns how many layers took
        each path, for the log."""
        linears = [m for m in self.model.modules() if isinstance(m, Linear)]
        step = fused_decode.linears_for_the_step(self.model, self.config.fused_decode)
        choices = choose_linears(
            [(m.in_features, m.out_features) for m in linears], self.dtype, requested,
            step_shapes=[(m.in_features, m.out_features) for m in step],
        )  # fmt: skip
        counts = {"plain": 0, "packed": 0, "gemv": 0}
        for module in linears:
            choice = choices[(module.in_features, module.out_features)]
            module.pack(choice.path, gemv_max_rows=choice.max_rows)
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

    def _calibrate_attention(self) -> None:
        """The CPU kernels' backend: how long a chunk after cached tokens may be and take the
        extend kernel on this machine (engine/kernels/cpu/extend_choice.py; once per machine)."""
        calibrate = getattr(self.attention, "calibrate", None)
        if calibrate is not None:
            hf = self.hf_config
            calibrate(hf.num_attention_heads, hf.num_key_value_heads, head_dim_of(hf),
                      self.block_size, self.kv_cache.dtype)  # fmt: skip

    def _place_model(self) -> None:
        """Where the model runs: it stays where it was loaded (a device runner moves it)."""

    def _allocate_kv_cache(self) -> None:
        hf = self.hf_config
        shape = kv_pool.KVPoolShape(
            hf.num_hidden_layers, self.block_size, hf.num_key_value_heads, head_dim_of(hf)
        )
        self.kv_pool = kv_pool.allocate(
            shape, self.config, self.max_model_len, self.dtype, self.device
        )
        kv_pool.attach(self.model, self.kv_pool)
        self.kv_cache, self.kv_cache_scales = self.kv_pool.cache, self.kv_pool.scales
        self.num_kv_blocks, self.kv_cache_bytes = self.kv_pool.num_kv_blocks, self.kv_pool.num_bytes
        self._layer_caches = self.kv_pool.layer_caches

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: the token sampled for every request with needs_sample, and the
        logprobs of the requests that asked for them."""
        if self._is_trim_due:  # the last step's temporaries are freed by now
            trim_heap()
            self._is_trim_due_fused = False
        self._is_trim_due = sum(len(r.token_ids) for r in out.scheduled) >= TRIM_AFTER_TOKENS
        if out.finished_request_ids and self._forward_takes_greedy:
            self._forward.drop_requests(out.finished_request_ids)
        speculated = self._speculate(out)
        if speculated is not None:
            return speculated
        requests, logits, greedy_ids, step_logprobs = self._run(out)
        if not requests:
            return ModelRunnerOutput({}, step_logprobs)
        token_ids = self.sampler(logits, requests, greedy_ids)
        add_sample_logprobs(step_logprobs, logits, requests, token_ids)
        sampled = {r.request_id: t for r, t in zip(requests, token_ids, strict=True)}
        return ModelRunnerOutput(sampled, step_logprobs)

    def _speculate(self, out: SchedulerOutput) -> ModelRunnerOutput | None:
        """A step of decodes that want their tokens only (greedy, or sampled with no logits
        processing), speculatively where the fused step can (`FusedDecode.speculate`,
        `speculate_batch`); None where not (then `_run` runs it)."""
        scheduled = out.scheduled
        if not 0 < len(scheduled) <= fused_decode.BATCH_MAX_REQUESTS:
            return None  # (a large batch's step is not held up by the checks below)
        if not getattr(self._forward, "speculates", False):
            return None
        if not all(map(_wants_tokens_only, scheduled)):
            return None
        self.sampler.drop(out.finished_request_ids)
        if out.finished_request_ids or out.preempted_request_ids:
            self._forward.forget_rows()  # their blocks were freed
        if self._is_trim_due_fused:
            trim_heap()
            self._is_trim_due_fused = False
        if len(scheduled) > 1:
            batch = self._forward.speculate_batch(
                scheduled, self.num_kv_blocks, self.max_model_len,
                [r.params.max_tokens - r.num_output_tokens for r in scheduled],
                [r.all_token_ids for r in scheduled], list(map(self._verifier, scheduled)),
            )  # fmt: skip
            if batch is None:
                return None
            ids = [r.request_id for r in scheduled]
            return ModelRunnerOutput(
                {i: t[0] for i, t in zip(ids, batch, strict=True)}, {},
                {i: t[1:] for i, t in zip(ids, batch, strict=True)},
            )  # fmt: skip
        request = scheduled[0]
        tokens = self._forward.speculate(
            request, self.num_kv_blocks, self.max_model_len,
            request.params.max_tokens - request.num_output_tokens, request.all_token_ids,
            self._verifier(request),
        )  # fmt: skip
        if tokens is None:
            return None
        request_id = request.request_id
        return ModelRunnerOutput({request_id: tokens[0]}, {}, {request_id: tokens[1:]})

    def _verifier(self, request: ScheduledRequest):
        """How a verifying step's rows give `request` its tokens: None for the greedy argmax,
        else the sampler's `verify` (each row drawn as its one-token step draws it)."""
        if takes_argmax(request):
            return None
        return lambda logits, proposals: self.sampler.verify(logits, request, proposals)

    @torch.inference_mode()
    def compute_logits(self, out: SchedulerOutput) -> dict[str, torch.Tensor]:
        """Run one step exactly like `execute` (K/V are written) but return the float32 logits
        [vocab] of each sampling request instead of sampling. For tests and debugging."""
        requests, logits, _, _ = self._run(out, needs_logits=True)
        return {r.request_id: logits[i].float() for i, r in enumerate(requests)}

    def _run(
        self, out: SchedulerOutput, needs_logits: bool = False
    ) -> tuple[
        list[ScheduledRequest], torch.Tensor | None, torch.Tensor | None, dict[str, StepLogprobs]
    ]:
        """schedule's output -> (requests that sample, their logits on the CPU, their greedy
        ids where the step found them already (else None), the step's prompt logprob chunks).
        The logits are None where the greedy ids are all the step's requests need and the
        fused step did not compute them all (`_run_decodes`), unless `needs_logits`.
        Device runners override only `_prepare`, `_forward_batch` and `_logits` (copies,
        graph replay), not this."""
        self.sampler.drop(out.finished_request_ids)
        if not out.scheduled:
            return [], None, None, {}
        if self._forward_takes_greedy:
            if out.finished_request_ids or out.preempted_request_ids:
                self._forward.forget_rows()  # their blocks were freed
            decoded = self._run_decodes(out.scheduled, needs_logits)
            if decoded is not None:
                return decoded
            self._is_trim_due_fused = True
        batch = self._prepare(out.scheduled)
        hidden = self._forward_batch(batch)  # [num_tokens, hidden]
        prompt_logprobs = prompt_logprobs_for_step(self.model, hidden, batch)
        if not batch.sample_requests:
            return [], None, None, prompt_logprobs
        greedy_ids_for = getattr(self._forward, "greedy_ids_for", None)
        greedy_ids = greedy_ids_for(hidden, batch.sample_rows) if greedy_ids_for else None
        return batch.sample_requests, self._logits(hidden, batch), greedy_ids, prompt_logprobs

    def _run_decodes(self, scheduled: list[ScheduledRequest], needs_logits: bool = False):
        """`_run` for a step of sampling decodes only, on the fused decode step, its inputs
        written from the requests (`FusedDecode.run_decodes`: no StepBatch, and the checks on
        what changed); None where that does not apply (then `_run` goes the general way)."""
        for request in scheduled:
            if len(request.token_ids) != 1 or not request.needs_sample:
                return None
            if request.params.prompt_logprobs is not None and request.num_output_tokens == 0:
                return None  # a one-token prompt that wants its prompt logprobs
        greedy = all(takes_argmax(r) for r in scheduled)
        # Greedy ids are all such a step needs unless a request wants its logprobs: the step
        # may then skip most of a bf16 lm_head (fused_decode.HeadScreen; logits None).
        ids_only = greedy and not needs_logits and all(r.params.logprobs is None for r in scheduled)
        forward = self._forward
        if self._is_trim_due_fused:  # the per-operator steps' temporaries: freed, not needed
            trim_heap()
            self._is_trim_due_fused = False
        hidden = forward.run_decodes(
            scheduled, greedy, self.num_kv_blocks, self.max_model_len, screen=ids_only
        )
        if hidden is None:
            return None
        rows = self._all_rows[: len(scheduled)]  # every row samples, in order
        return scheduled, forward.logits_for(hidden, rows), forward.greedy_ids_for(hidden, rows), {}

    def _forward_batch(self, batch: StepBatch) -> torch.Tensor:
        if self._forward_takes_greedy:
            # The fused step finds the greedy ids itself where every row takes them.
            greedy = all(takes_argmax(r) for r in batch.sample_requests)
            return self._forward(batch.input_ids, batch.positions, batch.meta, greedy)
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


def _wants_tokens_only(request: ScheduledRequest) -> bool:
    """A one-token decode that samples with no logits processing, grammar or logprobs: its
    tokens are all a speculative step has to give it."""
    params = request.params
    return (
        len(request.token_ids) == 1
        and request.needs_sample
        and not params.has_logits_processing
        and request.grammar is None
        and params.logprobs is None
        and (params.prompt_logprobs is None or request.num_output_tokens > 0)
    )
