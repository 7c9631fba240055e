"""LLMEngine: the streaming core. `step()` is three calls: schedule, run the model, post-process.

Single-threaded by design: the worker runs it on its own thread and talks to it through
queues. Nothing here knows about asyncio or Kafka.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import time
from pathlib import Path

import numpy as np
import structlog
import torch

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import PromptTooLongError
from engine.kv_cache_manager import cdiv
from engine.library_pages import release_library_pages
from engine.loader import load_tokenizer, resolve_model
from engine.logprobs import PromptLogprobsAccumulator, StepLogprobs
from engine.model_runner import ModelRunner
from engine.outputs import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, EngineStats, RequestDelta
from engine.platform import tune_process
from engine.request import Request
from engine.sampling_params import SamplingParams, derive_seed, sample_seed
from engine.scheduler import Scheduler
from engine.step_cost import calibrate_on

log = structlog.get_logger(__name__)

# Sample i > 0 of request R runs in the scheduler as R + this + i (sample 0 is R itself, so an
# n=1 request is unchanged). A control character: no id a client means to send contains it.
SAMPLE_ID_SEPARATOR = "\x1f"


def sample_request_id(request_id: str, index: int) -> str:
    return request_id if index == 0 else f"{request_id}{SAMPLE_ID_SEPARATOR}{index}"


def _eos_token_ids(model_path: Path, hf_config, tokenizer) -> set[int]:
    ids: set[int] = set()
    gen_path = model_path / "generation_config.json"
    if gen_path.exists():  # read as JSON: transformers' GenerationConfig only copies it
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
    else:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is not None:
        ids.update(eos if isinstance(eos, list | tuple) else [eos])
    return ids


class LLMEngine:
    def __init__(
        self,
        model: str | Path,
        dtype: str | torch.dtype = "auto",
        quantization: str | None = "auto",
        revision: str | None = None,
        **engine_config,
    ) -> None:
        self.config = EngineConfig.from_kwargs(**engine_config)
        tune_process(self.config.num_threads)  # before a GGUF is converted, too
        # Import-only library pages out of RSS before loading adds to it (engine/library_pages.py)
        release_library_pages("import")
        self.model_path = resolve_model(model, revision=revision)
        self.tokenizer = load_tokenizer(self.model_path)
        # The runner resolves dtype ("auto": from the checkpoint's config and this CPU).
        self.runner = _make_runner(self.model_path, self.config, dtype, quantization)
        self.dtype = self.runner.dtype
        self.max_model_len = self.runner.max_model_len
        self.vocab_size = self.runner.hf_config.vocab_size
        self.eos_token_ids = _eos_token_ids(self.model_path, self.runner.hf_config, self.tokenizer)
        self.scheduler = Scheduler(self.config, self.runner.num_kv_blocks)
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._prompt_logprobs: dict[str, PromptLogprobsAccumulator] = {}
        # request id -> ids of its unfinished samples, for requests with n > 1 only.
        self._samples: dict[str, list[str]] = {}
        self._num_arrivals = 0
        self._grammars = None  # engine/structured's GrammarCache, made on first use
        # Libraries imported lazily while loading leave exception/traceback cycles whose frames
        # hold this engine: collected now, a dropped engine frees its weights and KV pool at
        # once instead of at some later cyclic GC (found as a doubled peak RSS in the bench).
        gc.collect()
        # And the ones only loading used. What a step runs comes back at its first use (the
        # first request after start: ~30 ms more on the 2-core VM; the worker's calibration
        # below runs steps, so there it is before ready).
        release_library_pages("load")
        if self.config.has_step_cost:  # steps sized by time need costs
            self.scheduler.cost_model = calibrate_on(self)
            log.info("engine.step_cost_calibrated", model=repr(self.scheduler.cost_model))
        log.info(
            "engine_ready",
            model=str(self.model_path),
            dtype=str(self.dtype),
            num_kv_blocks=self.runner.num_kv_blocks,
            block_size=self.config.block_size,
            kv_cache_mib=round(self.runner.kv_cache_bytes / 2**20, 1),
            max_model_len=self.max_model_len,
        )

    # -- requests ------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass token ids, not text")
            return self.tokenizer.encode(prompt)
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        # One vectorised check, not a Python loop per token. Anything that is not a list of
        # integers (floats, strings, ints beyond 64 bits) gives a non-integer array.
        array = np.asarray(ids)
        if array.ndim != 1 or array.dtype.kind not in "iu":
            raise ValueError("prompt token ids must be a flat list of integers")
        if array.min() < 0 or array.max() >= self.vocab_size:
            bad = int(array[(array < 0) | (array >= self.vocab_size)][0])
            raise ValueError(f"prompt token id {bad} is not in [0, {self.vocab_size})")
        return array.tolist()

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
    ) -> None:
        """Queue a request (its `params.n` samples). Raises ValueError (with a message a user can
        act on) for an empty or too long prompt, a request that could never fit in the KV
        cache, or a duplicate id; nothing is queued then."""
        sample_ids = [sample_request_id(request_id, i) for i in range(params.n)]
        if any(i in self.scheduler.requests or i in self._samples for i in sample_ids):
            raise ValueError(f"request id {request_id!r} is already in the engine")
        prompt_ids = self.encode_prompt(prompt)
        if len(prompt_ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(prompt_ids)} tokens; the context is {self.max_model_len} "
                "tokens and at least one must be left to generate"
            )
        max_len = min(len(prompt_ids) + params.max_tokens, self.max_model_len)
        need = cdiv(max_len, self.config.block_size)
        if need > self.runner.num_kv_blocks:
            raise ValueError(
                f"prompt + max_tokens needs {need} KV blocks, the cache has {self.runner.num_kv_blocks}; "
                "lower max_tokens or raise kv_cache_memory_bytes"
            )
        self._check_logit_bias(params)
        grammars = [self._matcher(params) for _ in sample_ids]  # may raise: before queueing
        self._num_arrivals += 1
        seed = params.seed
        if seed is None:
            seed = derive_seed(f"engine:{self.config.seed}:{self._num_arrivals}")
        # Prompt logprobs are the prompt's: sample 0 reports them, the others need none (and
        # so can take the prompt's blocks from the prefix cache).
        sample_params = (
            dataclasses.replace(params, prompt_logprobs=None) if params.n > 1 else params
        )
        leader = None
        for index, (sample_id, grammar) in enumerate(zip(sample_ids, grammars, strict=True)):
            req = Request(
                sample_id, prompt_ids, params if index == 0 else sample_params,
                priority=priority, arrival_index=self._num_arrivals,
                seed=sample_seed(seed, index), group_id=request_id, sample_index=index,
            )  # fmt: skip
            req.grammar = grammar
            self.scheduler.add_request(req, leader)
            leader = leader or req
            self._detokenizers[sample_id] = IncrementalDetokenizer(
                self.tokenizer, prompt_ids, params
            )
        if params.n > 1:
            self._samples[request_id] = sample_ids
        if params.prompt_logprobs is not None:
            self._prompt_logprobs[request_id] = PromptLogprobsAccumulator(
                prompt_ids, params.prompt_logprobs
            )

    def _matcher(self, params: SamplingParams):
        """A grammar matcher of its own for each sample, or None without structured output."""
        if params.structured_output is None:
            return None
        return self._grammar_cache().matcher(params.structured_output)

    def _check_logit_bias(self, params: SamplingParams) -> None:
        if params.logit_bias and params.logit_bias[-1][0] >= self.vocab_size:  # sorted by id
            raise ValueError(
                f"logit_bias token id {params.logit_bias[-1][0]} is not in [0, {self.vocab_size})"
            )

    def _grammar_cache(self):
        """Built on the first structured request (xgrammar reads the whole vocabulary once)."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer, so it cannot constrain its output")
            from engine.structured.grammars import GrammarCache  # only structured requests need it
            from engine.tokenizer import as_transformers

            self._grammars = GrammarCache(
                as_transformers(self.tokenizer), self.vocab_size, sorted(self.eos_token_ids)
            )
        return self._grammars

    def abort_request(self, request_id: str) -> bool:
        """Stop a request (all its samples) wherever it is and free its blocks now. Emits no
        delta."""
        self._prompt_logprobs.pop(request_id, None)
        is_found = False
        for sample_id in self._samples.pop(request_id, [request_id]):
            req = self.scheduler.requests.get(sample_id)
            if req is None or req.group_id != request_id:
                continue  # gone, or a sample's internal id: only the caller's id aborts
            self._detokenizers.pop(sample_id, None)
            is_found = (
                self.scheduler.finish_request(sample_id, FINISH_ABORT) is not None or is_found
            )
        return is_found

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestDelta]:
        out = self.scheduler.schedule()
        if out.is_empty:
            if out.finished_request_ids:
                self.runner.execute(out)  # lets the runner drop per-request state
            return []
        started_s = time.perf_counter()
        result = self.runner.execute(out)
        # The online correction of the step cost; a speculative step (drafts and a verifying
        # step for one token's chunk) is not what the model prices.
        if self.scheduler.cost_model is not None and not result.extra:
            chunks = [(s.start_position, len(s.token_ids)) for s in out.scheduled]
            self.scheduler.cost_model.observe(chunks, (time.perf_counter() - started_s) * 1000)
        step_logprobs = result.logprobs
        for request_id, produced in step_logprobs.items():
            accumulator = self._prompt_logprobs.get(request_id)
            if produced.prompt_chunk is not None and accumulator is not None:
                accumulator.add(produced.prompt_chunk)
        updated = self.scheduler.update_from_output(out, result.sampled)
        extra = result.extra
        deltas = []
        for req in updated:
            deltas += self._postprocess(
                req, step_logprobs.get(req.request_id), extra.get(req.request_id)
            )
        return deltas

    def _finish_reason(self, req: Request, token: int) -> str | None:
        p = req.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return FINISH_STOP
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return FINISH_LENGTH
        return None

    def _grammar_done(self, req: Request, token: int) -> bool:
        """Advance the request's matcher; True when the grammar allows nothing more (it accepted
        a stop token: with ignore_eos too, since a finished grammar allows no other token)."""
        if not req.grammar.accept(token):  # the mask makes this unreachable; stop, never loop
            log.warning("grammar_rejected_token", request_id=req.request_id, token_id=token)
            return True
        return req.grammar.is_terminated

    def _postprocess(
        self,
        req: Request,
        logprobs: StepLogprobs | None = None,
        extra: list[int] | None = None,
    ) -> list[RequestDelta]:
        """The delta of the token the step appended to `req`, then one delta for each of the
        `extra` tokens it verified after it (a speculative step), each taken only while the
        request is not finished: a stop token, a stop string or max_tokens ends it where a
        one-token step would have. A delta a token, as one-token steps make them, so the
        messages a worker publishes do not depend on how many tokens a step verified."""
        reason = self._advance(req, req.all_token_ids[-1])
        deltas = [self._delta(req, reason)]
        if logprobs is not None and logprobs.sample is not None:
            deltas[0].logprobs = [self._decoded(logprobs.sample)]
        accumulator = self._prompt_logprobs.pop(req.request_id, None)  # sample 0's id
        if accumulator is not None:  # the first delta carries the whole prompt's
            deltas[0].prompt_logprobs = [e and self._decoded(e) for e in accumulator.entries]
        for token in extra or ():
            if reason is not None:
                break
            self.scheduler.accept_token(req, token)
            reason = self._advance(req, token)
            deltas.append(self._delta(req, reason))
        if reason is not None:
            self.scheduler.finish_request(req.request_id, reason)
            self._detokenizers.pop(req.request_id, None)
        return deltas

    def _delta(self, req: Request, reason: str | None) -> RequestDelta:
        """The delta of the token `req` last took (`reason`: why it finishes with it, or None)."""
        finished = reason is not None
        return RequestDelta(
            request_id=req.group_id,
            text=self._detokenizers[req.request_id].flush(finished),
            token_ids=[req.all_token_ids[-1]],
            finished=finished,
            finish_reason=reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            num_cached_tokens=req.num_cached_tokens or 0,
            index=req.sample_index,
            num_samples_running=self._num_other_samples(req, finished),
        )

    def _advance(self, req: Request, token: int) -> str | None:
        """`token`, just appended to `req`, through its grammar and detokenizer: why the request
        finishes with it, or None."""
        reason = self._finish_reason(req, token)
        if req.grammar is not None and reason is None and self._grammar_done(req, token):
            reason = FINISH_STOP
        detok = self._detokenizers[req.request_id]
        detok.add_token(token, is_last=reason is not None)
        if reason is None and detok.stopped_on is not None:
            reason = FINISH_STOP
        return reason

    def _num_other_samples(self, req: Request, finished: bool) -> int:
        """Samples of req's request still running besides req (which leaves if `finished`)."""
        sample_ids = self._samples.get(req.group_id)
        if sample_ids is None:
            return 0
        if finished:
            sample_ids.remove(req.request_id)
            if not sample_ids:
                del self._samples[req.group_id]
            return len(sample_ids)
        return len(sample_ids) - 1

    def _decoded(self, entry: dict) -> dict:
        if self.tokenizer is not None:
            for token_id, logprob in entry.items():
                logprob.decoded_token = self.tokenizer.decode([token_id])
        return entry

    def get_stats(self) -> EngineStats:
        s = self.scheduler
        fused_steps, one_thread, gil_wait_s = self.runner.fused_step_counters()
        return EngineStats(
            num_blocks_total=s.kv.num_blocks,
            num_blocks_free=s.kv.num_free_blocks,
            num_blocks_cached=s.kv.pool.num_cached_free_blocks,
            num_running=len(s.running),
            num_waiting=s.num_waiting,
            num_preemptions=s.num_preemptions,
            num_prefix_queries=s.num_prefix_queries,
            num_prefix_hits=s.num_prefix_hits,
            num_tokens_computed=s.num_tokens_computed,
            num_tokens_reused=s.num_tokens_reused,
            num_fused_steps=fused_steps,
            num_fused_steps_one_thread=one_thread,
            fused_step_gil_wait_s=gil_wait_s,
            **self.runner.draft_counters(),
        )


def _make_runner(model_path: Path, config: EngineConfig, dtype, quantization) -> ModelRunner:
    """The CPU runner, or on a GPU (`device` "cuda", or "auto" with CUDA available) the CUDA one."""
    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return ModelRunner(model_path, config, dtype, quantization)
    if not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch sees no CUDA GPU; use device='cpu' or 'auto'")
    from engine.cuda_runner import CudaModelRunner  # Triton and CUDA graphs: only on a GPU

    return CudaModelRunner(
        model_path, config, dtype, quantization, use_cuda_graphs=config.cuda_graphs
    )
