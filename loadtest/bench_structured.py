"""Structured output's cost: W2 (32 chat requests x 128 tokens, greedy, EOS ignored) with every
request constrained by a JSON schema against the same requests unconstrained, on one engine,
rounds alternating, medians compared.

The schema asks for an array of at least 50 objects, so no request can complete its grammar
(and leave the batch early) within 128 tokens: both sides generate exactly the same number of
tokens at the same batch width, and the throughput ratio is the mask's cost. The sampler's own
time per step (penalties / mask included) is measured on both sides too.

    mini-infer bench structured [--model smollm2-135m] [--dtype bfloat16] [--rounds 3]
        [--max-tokens 128] [--out r.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from loadtest.report import summarize
from loadtest.workloads import ENGINE_OPTIONS, W2_NUM_REQUESTS, chat_prompts

SCHEMA = {
    "type": "array",
    "minItems": 50,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "tags": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["name", "age", "tags"],
    },
}


class SamplerTimer:
    """Wraps the runner's sampler: seconds per call (one call per step with sampling rows)."""

    def __init__(self, sampler):
        self.sampler, self.calls_s = sampler, []

    def __call__(self, logits, requests):
        start = time.perf_counter()
        out = self.sampler(logits, requests)
        self.calls_s.append(time.perf_counter() - start)
        return out

    def __getattr__(self, name):
        return getattr(self.sampler, name)


def run_side(eng, prompts, max_tokens: int, structured, tag: str) -> dict:
    from engine import SamplingParams

    timer = eng.runner.sampler
    timer.calls_s.clear()
    params = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, structured_output=structured
    )
    start = time.perf_counter()
    first: dict[str, float] = {}
    num_tokens = 0
    for i, prompt in enumerate(prompts):
        eng.add_request(f"{tag}-{i}", prompt, params)
    while eng.has_unfinished_requests():
        for delta in eng.step():
            num_tokens += len(delta.token_ids)
            first.setdefault(delta.request_id, time.perf_counter() - start)
    result = summarize(num_tokens, time.perf_counter() - start, list(first.values()))
    result.pop("ttfts_ms")
    result["sampler_ms_per_step"] = round(statistics.median(timer.calls_s) * 1000, 3)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    from engine import LLMEngine
    from engine.sampling_params import StructuredOutput

    # The prefix cache would serve later rounds' prompts; off, so every round prefills alike.
    eng = LLMEngine(
        args.model, dtype=args.dtype, **{**ENGINE_OPTIONS, "enable_prefix_caching": False}
    )
    eng.runner.sampler = SamplerTimer(eng.runner.sampler)
    prompts = chat_prompts(eng.tokenizer, W2_NUM_REQUESTS)
    structured = StructuredOutput("json_schema", json.dumps(SCHEMA))
    compile_start = time.perf_counter()
    run_side(eng, prompts[:2], 4, structured, "warm-s")  # compiles the grammar
    compile_s = time.perf_counter() - compile_start
    run_side(eng, prompts[:2], 4, None, "warm-u")
    sides = {"unconstrained": None, "json_schema": structured}
    rounds: dict[str, list[dict]] = {name: [] for name in sides}
    for r in range(args.rounds):
        for name, spec in sides.items():  # alternate the two sides within each round
            rounds[name].append(run_side(eng, prompts, args.max_tokens, spec, f"{name}-{r}"))
    medians = {
        name: {
            key: statistics.median(run[key] for run in runs)
            for key in ("tokens_per_s", "sampler_ms_per_step")
        }
        for name, runs in rounds.items()
    }
    ratio = medians["json_schema"]["tokens_per_s"] / medians["unconstrained"]["tokens_per_s"]
    doc = {
        "bench": "structured", "model": args.model, "dtype": args.dtype, "workload": "W2",
        "num_requests": W2_NUM_REQUESTS, "max_tokens": args.max_tokens, "rounds": rounds,
        "medians": medians, "throughput_ratio": round(ratio, 3),
        "grammar_compile_s": round(compile_s, 3), "load_avg": os.getloadavg(),
    }  # fmt: skip
    print(f"{'side':<16}{'tok/s (median)':>16}{'sampler ms/step':>18}")
    for name, m in medians.items():
        print(f"{name:<16}{m['tokens_per_s']:>16.1f}{m['sampler_ms_per_step']:>18.2f}")
    print(
        f"constrained / unconstrained throughput: {ratio:.3f}  (load avg {os.getloadavg()[0]:.1f})"
    )
    print(json.dumps(doc, indent=2))
    if args.out:
        args.out.write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
