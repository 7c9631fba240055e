"""What sampling a step's tokens costs: `Sampler` on one decode step's logits of W2's shape
(32 rows of the default model's vocabulary), temperature and top-p as a chat service sends
them, the median of `--calls` calls per round.

The logits are the model's own: one step of 32 chat prompts, so the nucleus has the size it
has in serving (random logits make it thousands of tokens wide and measure another thing).
Each side runs in a fresh process, alternating for `--rounds`; `--baseline DIR` runs the same
against another checkout's sampler (loadtest/trees.py).

    python -m loadtest.bench_sampler [--rounds 3] [--temperature 0.7] [--top-p 0.9]
        [--top-k 0] [--baseline DIR] [--out r.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from loadtest.report import emit
from loadtest.trees import alternate, print_result, sides_of


def _step_logits(num_requests: int):
    """The logits [num_requests, vocab] (bf16, as the fused step leaves them) of the first
    decode step of W2's chat prompts."""
    from engine import LLMEngine, SamplingParams
    from loadtest.workloads import ENGINE_OPTIONS, chat_prompts

    engine = LLMEngine("smollm2-135m", **ENGINE_OPTIONS)
    prompts = chat_prompts(engine.tokenizer, num_requests)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=2, temperature=0.0))
    engine.step()  # the prompts (and each request's first token)
    out = engine.scheduler.schedule()
    logits = engine.runner.compute_logits(out)
    return engine, [logits[str(i)] for i in range(num_requests)]


def _child(args) -> None:
    import torch

    from engine.sampler import Sampler
    from engine.sampling_params import SamplingParams
    from engine.scheduler_output import ScheduledRequest

    _, rows = _step_logits(args.num_requests)
    logits = torch.stack(rows).to(torch.bfloat16)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    requests = [ScheduledRequest(f"r{i}", [1], 0, [0], True, params, i)
                for i in range(args.num_requests)]  # fmt: skip
    sampler = Sampler()
    for _ in range(5):
        sampler(logits, requests)
    times = []
    for _ in range(args.calls):
        start = time.perf_counter()
        sampler(logits, requests)
        times.append(time.perf_counter() - start)
    print_result({"ms_per_call": round(statistics.median(times) * 1e3, 3)})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--baseline", type=Path, help="another checkout to compare with")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args)
        return 0
    flags = ["--child", "--calls", str(args.calls), "--num-requests", str(args.num_requests),
             "--temperature", str(args.temperature), "--top-p", str(args.top_p),
             "--top-k", str(args.top_k)]  # fmt: skip
    runs = alternate(__file__, sides_of(args.baseline), flags, args.rounds, timeout_s=600)
    medians = {name: statistics.median(r["ms_per_call"] for r in rs) for name, rs in runs.items()}
    print(f"\n{'side':10} {'ms per call':>12}   ({args.num_requests} rows, temperature "
          f"{args.temperature}, top-p {args.top_p}, top-k {args.top_k}; medians of {args.rounds})")
    for name, ms in medians.items():
        print(f"{name:10} {ms:12.3f}")
    doc = {"rows": args.num_requests, "temperature": args.temperature, "top_p": args.top_p,
           "top_k": args.top_k, "medians_ms": medians, "rounds": runs}  # fmt: skip
    if "baseline" in medians:
        doc["this_over_baseline"] = round(medians["this"] / medians["baseline"], 3)
        print(f"time per call, this / baseline: {doc['this_over_baseline']}")
    emit(doc, args.out, None, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
