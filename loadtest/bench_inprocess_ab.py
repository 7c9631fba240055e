"""Two engines in one process, built with a module constant set two ways, W1 (or `--num-requests`
prompts together) alternating.

A change of a few percent is below what tree-against-tree runs resolve on a noisy 2-core host
(each process lands its weights on other pages and meets another minute of the host's pace).
Here both sides share the process, the minute and the machine: two `LLMEngine`s are built, side
A's after its `--set-a` assignments and side B's after `--set-b`'s (each a constant read when the
engine is built, e.g. `engine.kernels.cpu.decode_step.LEAST_TAKE_BYTES=65536`; restored after),
then each round runs W1 (the chat prompt, `--max-tokens` greedy tokens, no EOS; with
`--num-requests N`, N distinct chat prompts together, W2's shape at 32) on both, the
order flipped every round. `--load-order b,a` builds B first, to take the build order out of a
result (run it both ways). Prints each round, the medians and the pairwise median of A/B, and the
JSON.

`--task-clocks` also times the fused step's tasks in every round (decode_step.cpp's per-task
clocks, as `bench engine --profile` reads them; the thread choice is off while they run): per
kind of task, the threads' mean work plus their mean wait at the barrier after it, in ms a step,
which is the time the step spends on that kind. A change to a small part of the step (a norm,
SiLU * up) shows there, where the whole step's tokens a second drown it in the host's pace.

    python -m loadtest.bench_inprocess_ab --model DIR \\
        --set-a engine.kernels.cpu.decode_step.LEAST_TAKE_BYTES=65536 \\
        --set-b engine.kernels.cpu.decode_step.LEAST_TAKE_BYTES=1099511627776 --rounds 10
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

from loadtest.report import emit


def parse_assignment(text: str) -> tuple[str, str, object]:
    """`package.module.NAME=literal` -> (module, name, value); the value a Python literal."""
    target, sep, literal = text.partition("=")
    module, dot, name = target.strip().rpartition(".")
    if not sep or not dot or not name.isidentifier():
        raise ValueError(f"{text!r}: expected package.module.NAME=value")
    try:
        value = ast.literal_eval(literal.strip())
    except (ValueError, SyntaxError) as error:
        raise ValueError(f"{text!r}: the value must be a Python literal") from error
    return module, name, value


def build_with(assignments: list[str], build):
    """`build()` with the assignments in force, the constants restored after."""
    saved = []
    try:
        for text in assignments:
            module_name, name, value = parse_assignment(text)
            module = importlib.import_module(module_name)
            if not hasattr(module, name):
                raise ValueError(f"{module_name} has no {name}")
            saved.append((module, name, getattr(module, name)))
            setattr(module, name, value)
        return build()
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)


def run(args) -> dict:
    from engine import LLMEngine, SamplingParams
    from engine.loader import load_tokenizer, resolve_model
    from loadtest.workloads import chat_prompts

    prompts = chat_prompts(load_tokenizer(resolve_model(args.model)), args.num_requests)
    prompt = prompts[0]
    options = json.loads(args.options)
    settings = {"a": args.set_a, "b": args.set_b}
    order = args.load_order.split(",")
    if sorted(order) != ["a", "b"]:
        raise SystemExit("--load-order is a,b or b,a")

    def build():
        eng = LLMEngine(args.model, dtype="bfloat16", **options)
        warm = SamplingParams(max_tokens=8, temperature=0.0)
        eng.add_request("warmup", prompt[::-1], warm)  # shares no block with the prompt
        _generate(eng)
        return eng

    engines = {side: build_with(settings[side], build) for side in order}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    speeds: dict[str, list[float]] = {"a": [], "b": []}
    clocks: dict[str, list[dict[str, float]]] = {"a": [], "b": []}  # per round: kind -> ms/step
    for r in range(args.rounds):
        for side in order if r % 2 == 0 else order[::-1]:
            eng = engines[side]
            for i, each in enumerate(prompts):
                eng.add_request(f"r{r}-{i}", each, params)
            start = time.perf_counter()
            if args.task_clocks:
                num_tokens, spans = _timed(eng)
                clocks[side].append(spans)
            else:
                num_tokens, _ = _generate(eng)
            speeds[side].append(round(num_tokens / (time.perf_counter() - start), 2))
        print(f"round {r + 1}/{args.rounds}: A {speeds['a'][-1]:.1f} tok/s, "
              f"B {speeds['b'][-1]:.1f}", flush=True)  # fmt: skip
    medians = {side: statistics.median(v) for side, v in speeds.items()}
    pairwise = statistics.median(a / b for a, b in zip(speeds["a"], speeds["b"], strict=True))
    print(f"\n{args.num_requests}x{args.max_tokens}, tok/s medians of {args.rounds}: A {medians['a']:.1f}, "
          f"B {medians['b']:.1f}; A/B pairwise median {pairwise:.3f}, ratio of medians "
          f"{medians['a'] / medians['b']:.3f}")  # fmt: skip
    result = {
        "model": args.model, "options": options, "max_tokens": args.max_tokens,
        "num_requests": args.num_requests,
        "set_a": args.set_a, "set_b": args.set_b, "load_order": order,
        "tokens_per_s": speeds, "medians": medians,
        "a_over_b_pairwise_median": round(pairwise, 3),
        "a_over_b_ratio_of_medians": round(medians["a"] / medians["b"], 3),
    }  # fmt: skip
    if args.task_clocks:
        result["task_ms_per_step"] = clocks
        result["task_ms_medians"] = _clock_medians(clocks)
        print(f"\nthe fused step's tasks, ms a step (work + wait), medians of {args.rounds}:")
        for kind, sides in result["task_ms_medians"].items():
            print(f"  {kind:<18} A {sides['a']:8.3f}   B {sides['b']:8.3f}")
    return result


def _generate(eng) -> tuple[int, int]:
    """Steps `eng` until its requests are done: (tokens, steps)."""
    num_tokens = num_steps = 0
    while eng.has_unfinished_requests():
        num_tokens += sum(len(d.token_ids) for d in eng.step())
        num_steps += 1
    return num_tokens, num_steps


def _timed(eng) -> tuple[int, dict[str, float]]:
    """`_generate(eng)` with the fused step's task clocks on: its tokens and, per kind of task,
    ms a step."""
    from loadtest.profile_step import run_with_task_clocks, task_split

    fused = eng.runner._forward.fused
    (num_tokens, num_steps), tasks = run_with_task_clocks(
        fused.plan, fused.task_names, lambda: _generate(eng)
    )
    split = task_split(tasks, max(1, num_steps))
    return num_tokens, {k: round(e["work"] + e["wait"], 4) for k, e in split.items()}


def _clock_medians(clocks: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    kinds = {k for rounds in clocks.values() for spans in rounds for k in spans}
    return {
        kind: {side: round(statistics.median(s.get(kind, 0.0) for s in clocks[side]), 4)
               for side in "ab"}
        for kind in sorted(kinds)
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--options", default='{"quantization": "int4"}', help="engine options")
    parser.add_argument("--set-a", action="append", default=[], metavar="MODULE.NAME=VALUE")
    parser.add_argument("--set-b", action="append", default=[], metavar="MODULE.NAME=VALUE")
    parser.add_argument("--load-order", default="a,b", help="a,b or b,a: which is built first")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--num-requests", type=int, default=1,
        help="distinct chat prompts run together each round (1: W1; 32: W2's shape)",
    )  # fmt: skip
    parser.add_argument(
        "--task-clocks",
        action="store_true",
        help="also time the fused step's tasks, per kind, every round",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    emit(run(args), args.out, None, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
