"""n samples of one prompt (SamplingParams.n) against n requests with that prompt, sent together.

    python -m loadtest.bench_num_samples [--model smollm2-135m] [--n 4] [--prompt-tokens 384]
        [--max-tokens 32] [--rounds 3] [--out r.json]

The same engine runs both sides, alternating, for `--rounds` rounds; each run has a prompt of
its own (a distinct first sentence), so no run finds another's blocks in the prefix cache.
Request i is seeded as sample i (seed + i). Prints a table (medians) and the JSON: wall seconds,
tokens computed (prompt and decode), and their ratios. That the samples equal those requests'
completions on one prompt is a test (tests/engine/test_num_samples.py), not measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from engine import LLM, SamplingParams

FILLER = (
    "Kafka streams prompts to workers and the workers stream tokens back, block by block, "
    "while the scheduler keeps the batch full and the cache warm. "
)


def _prompt(llm: LLM, label: str, num_tokens: int) -> list[int]:
    ids = llm.tokenizer.encode(f"{label}. " + FILLER * (1 + num_tokens // 20))
    return ids[:num_tokens]


def _run(llm: LLM, prompt: list[int], args, is_n: bool) -> dict:
    params = dict(max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True)
    before = llm.get_stats().num_tokens_computed
    started_s = time.perf_counter()
    if is_n:
        out = llm.generate(prompt, SamplingParams(**params, seed=1, n=args.n))[0]
        token_ids = [c.token_ids for c in out.choices]
    else:
        outs = llm.generate(
            [prompt] * args.n, [SamplingParams(**params, seed=1 + i) for i in range(args.n)]
        )
        token_ids = [o.token_ids for o in outs]
    wall_s = time.perf_counter() - started_s
    computed = llm.get_stats().num_tokens_computed - before
    return {"wall_s": wall_s, "tokens_computed": computed, "token_ids": token_ids}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=384)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    llm = LLM(args.model)
    _run(llm, _prompt(llm, "Warm-up", args.prompt_tokens), args, is_n=True)
    sides: dict[str, list[dict]] = {"n_samples": [], "n_requests": []}
    for r in range(args.rounds):
        order = ["n_samples", "n_requests"] if r % 2 == 0 else ["n_requests", "n_samples"]
        for side in order:
            prompt = _prompt(llm, f"Round {r}, side {side}", args.prompt_tokens)
            sides[side].append(_run(llm, prompt, args, is_n=side == "n_samples"))
    medians = {
        side: {
            key: statistics.median(run[key] for run in runs)
            for key in ("wall_s", "tokens_computed")
        }  # fmt: skip
        for side, runs in sides.items()
    }
    base, new = medians["n_requests"], medians["n_samples"]
    result = {
        "model": args.model, "n": args.n, "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens, "rounds": args.rounds, "medians": medians,
        "speedup": base["wall_s"] / new["wall_s"],
        "tokens_computed_ratio": new["tokens_computed"] / base["tokens_computed"],
        "load_average": os.getloadavg(),
    }  # fmt: skip
    print(f"{'side':<12} {'wall s (median)':>16} {'tokens computed':>16}")
    for side, m in medians.items():
        print(f"{side:<12} {m['wall_s']:>16.2f} {m['tokens_computed']:>16.0f}")
    print(f"n={args.n} samples vs {args.n} requests: {result['speedup']:.2f}x wall, "
          f"{result['tokens_computed_ratio']:.2f}x tokens computed, load {result['load_average']}")  # fmt: skip
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
