"""`LLM`: the offline, vLLM-style entry point. `LLM(model).generate(prompts, params)`."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams


class LLM:
    """Load a model once, generate for many prompts with continuous batching.

    `model`: a Hugging Face checkpoint directory, a hub id ("Qwen/Qwen3-0.6B", at `revision`:
    a branch, tag or commit; fetched into the hub cache), a `.gguf` file, or the alias
    `smollm2-135m` (README.md, "Models", lists the architectures). `dtype`: "auto",
    "float32", "bfloat16" or "float16"; `quantization`: "auto" (a GGUF runs in its own
    quantization), None / "none", "int8", "int4", ... (both resolved by engine/precision.py:
    the default model runs int4 with bf16 compute where the CPU has bf16; `dtype="float32",
    quantization=None` is the HF-exact path). Extra keyword arguments are `EngineConfig`
    fields.
    """

    def __init__(
        self,
        model: str | Path = "smollm2-135m",
        dtype: str = "auto",
        quantization: str | None = "auto",
        revision: str | None = None,
        **engine_config,
    ) -> None:
        self.engine = LLMEngine(
            model, dtype=dtype, quantization=quantization, revision=revision, **engine_config
        )
        self._num_calls = 0

    @property
    def model_path(self) -> Path:
        return self.engine.model_path

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_stats(self):
        return self.engine.get_stats()

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priorities: Sequence[int] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Generate for all prompts together; outputs come back in prompt order. A prompt whose
        params have n > 1 gets its n samples in `RequestOutput.choices` (choice 0 also in the
        output's own text/token_ids/finish_reason/logprobs, as for n=1)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None:
            params = SamplingParams()
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} SamplingParams")
        priorities = list(priorities) if priorities is not None else [0] * len(prompts)

        self._num_calls += 1
        ids = [f"llm-{self._num_calls}-{i}" for i in range(len(prompts))]
        for rid, prompt, p, prio in zip(ids, prompts, params_list, priorities, strict=True):
            try:
                self.engine.add_request(rid, prompt, p, priority=prio)
            except ValueError:
                for added in ids:  # leave the engine as it was
                    self.engine.abort_request(added)
                raise

        prompt_ids = {rid: self.engine.scheduler.requests[rid].prompt_token_ids for rid in ids}
        num_samples = {rid: p.n for rid, p in zip(ids, params_list, strict=True)}
        samples = {(rid, i): _Sample() for rid, n in num_samples.items() for i in range(n)}
        prompt_logprobs: dict[str, list] = {}
        num_cached: dict[str, int] = {}
        results: dict[str, RequestOutput] = {}
        bar = _progress(len(ids), use_tqdm)
        try:
            while len(results) < len(ids):
                for d in self.engine.step():
                    samples[d.request_id, d.index].add(d)
                    if d.prompt_logprobs is not None:
                        prompt_logprobs[d.request_id] = d.prompt_logprobs
                    if d.index == 0 and d.finished:
                        num_cached[d.request_id] = d.num_cached_tokens
                    if d.is_request_finished:
                        choices = [
                            samples[d.request_id, i].output(i)
                            for i in range(num_samples[d.request_id])
                        ]
                        results[d.request_id] = RequestOutput(
                            request_id=d.request_id,
                            prompt_token_ids=prompt_ids[d.request_id],
                            text=choices[0].text,
                            token_ids=choices[0].token_ids,
                            finish_reason=choices[0].finish_reason,
                            num_cached_tokens=num_cached[d.request_id],
                            prompt_logprobs=prompt_logprobs.get(d.request_id),
                            logprobs=choices[0].logprobs,
                            choices=choices,
                        )
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
            for rid in ids:
                if rid not in results:
                    self.engine.abort_request(rid)
        return [results[rid] for rid in ids]


class _Sample:
    """One sample's deltas, gathered."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list = []
        self.finish_reason: str | None = None

    def add(self, delta) -> None:
        self.texts.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            self.logprobs.extend(delta.logprobs)
        if delta.finished:
            self.finish_reason = delta.finish_reason

    def output(self, index: int) -> CompletionOutput:
        return CompletionOutput(
            index=index,
            text="".join(self.texts),
            token_ids=self.token_ids,
            finish_reason=self.finish_reason,
            logprobs=self.logprobs or None,
        )


def _progress(total: int, use_tqdm: bool | None):
    if use_tqdm is None:
        use_tqdm = sys.stderr.isatty() and total > 1
    if not use_tqdm:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="generate", unit="req", file=sys.stderr)
