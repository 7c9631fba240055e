"""Where a speculative decoding step's time goes (engine/fused_decode.py `speculate`): the fused
step's plans timed alone, in rounds that alternate them: a draft step (one row on the int4
copies), a one-token step (one row) and verifying steps of 2 to DRAFT_TOKENS + 1 rows, each
over the same context of a request that has decoded a while. With the drafts' acceptance from
a greedy run, what a token costs each way (k = DRAFT_TOKENS):

    one-token:    t(1 row)
    speculative:  (k * t(draft) + t(k + 1 rows)) / (tokens per verifying step)

Then the same per kind of task inside the plans (summed over layers, the threads' mean work).
Prints a table and the JSON (`--out` also writes it).

With `--quantization int4` (or int8) there is no draft: the proposals come from the request's
own tokens (engine/ngram_lookup.py), and the verifying steps have 2 to LOOKUP_TOKENS + 1 rows.
A token then costs, over the greedy run's steps (one-token steps n1, verifying steps of r rows
n_r, tokens T):

    speculative:  (n1 * t(1 row) + sum_r n_r * t(r rows)) / T

With `--together N` (int4/int8): the prompts in groups of N requests decoding together (greedy,
or sampled with `--temperature`, each request seeded), with their proposals verified in one step (`FusedDecode.speculate_batch`) against the same groups
with that off (a request then speculates only once it decodes alone), alternating in ABBA
order for `--wall-rounds` rounds: tok/s each way, the proposals kept in the verifying steps of
several requests, and how many answers came out the same (they may part once a request of the
group has finished: the others then decode in steps of fewer rows).

    python -m loadtest.bench_speculative [--model smollm2-135m] [--quantization int4] \
        [--rounds 5] [--together N] [--out r.json]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from loadtest.profile_step import run_with_task_clocks, task_split
from loadtest.report import emit

NUM_RUNS = 40  # runs of a plan per round (the first few after another plan warm its buffers)


def _timed(fn, runs: int = NUM_RUNS) -> float:
    """Median ms of `fn` over `runs` calls."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _task_split(plan, names: list[str], run, runs: int = NUM_RUNS) -> dict[str, float]:
    """ms per run and kind of task: the threads' mean work (the plan's own clocks)."""
    _, tasks = run_with_task_clocks(plan, names, lambda: [run() for _ in range(runs)])
    return {k: round(e["work"], 3) for k, e in task_split(tasks, runs).items()}


def _last_rows(eng, fused, request_id: str, num_rows: int) -> tuple[int, int]:
    """The step's rows 0..num_rows-1 written with the request's last `num_rows` computed
    positions (a plan over them rewrites their K/V with the same bits); the one-row attention
    split that covers them all, for `_set_step`."""
    request = eng.scheduler.requests[request_id]
    blocks = eng.scheduler.kv.block_ids(request_id)
    first = request.num_computed_tokens - num_rows
    for row in range(num_rows):
        fused._write_row(row, request_id, first + row, blocks, request.all_token_ids[first + row],
                         eng.runner.num_kv_blocks, eng.max_model_len)  # fmt: skip
    return fused._partitions(1, (first + num_rows - 1) // fused.block_size + 1)


def _time_plans(fused, sides: dict, split: tuple[int, int], rounds: int) -> tuple[dict, dict]:
    """`sides`: name -> (plan, its task names, rows, what `speculate` sets for it). Each side's
    ms per run in `rounds` alternating rounds, and its tasks' split (`_task_split`)."""
    from engine.kernels.cpu import decode_step

    spin = decode_step.SPIN
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(rounds):
        for name, (plan, _, rows, flags) in sides.items():
            fused._set_step(*split, **flags)
            times[name].append(round(_timed(lambda p=plan, r=rows: p.run(r, 0, spin)), 3))
    tasks = {}
    for name, (plan, names, rows, flags) in sides.items():
        fused._set_step(*split, **flags)
        tasks[name] = _task_split(plan, names, lambda p=plan, r=rows: p.run(r, 0, spin))
    return times, tasks


def _per_token(one_token_ms: float, speculative_ms: float) -> dict[str, float]:
    return {"one_token": round(one_token_ms, 3), "speculative": round(speculative_ms, 3),
            "ratio": round(one_token_ms / speculative_ms, 3)}  # fmt: skip


def _report(doc: dict, run_line: str) -> None:
    """The table: the plans' times, the greedy run (`run_line`), a token's cost, the tasks."""
    times, medians, tasks = doc["plan_ms"], doc["medians_ms"], doc["tasks_ms"]
    print(f"plans, ms (medians of {doc['rounds']} alternating rounds of {NUM_RUNS} runs)")
    for name, ts in times.items():
        print(f"  {name:8} {medians[name]:7.2f}   rounds: {', '.join(f'{t:.2f}' for t in ts)}")
    print(run_line)
    p = doc["per_token_ms"]
    print(f"per token, ms: one-token {p['one_token']:.2f}, speculative {p['speculative']:.2f} "
          f"({p['ratio']:.2f}x)")  # fmt: skip
    print(f"\n{'task (ms, threads mean work)':28} " + " ".join(f"{n:>8}" for n in tasks))
    for kind in tasks["1 row"]:
        cells = " ".join(f"{tasks[n].get(kind, 0.0):8.3f}" for n in tasks)
        print(f"  {kind:26} {cells}")
    wall = doc.get("wall_clock")
    if wall:
        print(f"\nwall-clock, tok/s: on {wall['tok_s']['on']}, off {wall['tok_s']['off']}; "
              f"on / off {wall['on_over_off']} (median {wall['median_on_over_off']}); "
              f"the same tokens: {wall['same_tokens']}")  # fmt: skip


def run(args) -> dict:
    from engine import LLMEngine, SamplingParams
    from loadtest.workloads import chat_prompts

    eng = LLMEngine(args.model, dtype="bfloat16", quantization=args.quantization or None,
                    speculative_decoding="on", linear_kernel=args.linear_kernel)  # fmt: skip
    fused = eng.runner._forward.fused
    if fused.draft is None and fused.lookup is None:
        raise SystemExit(f"no speculative decoding here: {eng.runner.fused_decode or 'on'}")
    if args.together:
        return _together(args, eng, fused)
    if fused.draft is None:
        return _run_lookup(args, eng, fused)
    fused.lookup = None  # the draft alone: its steps are what the breakdown prices
    from engine.fused_decode import DRAFT_TOKENS

    prompt = chat_prompts(eng.tokenizer, 1)[0]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    eng.add_request("run", prompt, params)
    start = time.perf_counter()
    request = eng.scheduler.requests["run"]
    while request.num_output_tokens < args.max_tokens - 2 * (DRAFT_TOKENS + 1):
        eng.step()
    run_s = time.perf_counter() - start
    num_run = request.num_output_tokens
    # Rows at the request's last computed positions (rewriting their K/V with the same bits):
    # every plan below runs them, 1 to DRAFT_TOKENS + 1 rows.
    num_rows = DRAFT_TOKENS + 1
    split = _last_rows(eng, fused, "run", num_rows)
    # (plan, its task names, rows, what `speculate` sets for it)
    sides = {
        "draft": (fused.draft_plan, fused.draft_task_names, 1, {}),
        "1 row": (fused.plan, fused.task_names, 1, {"screen": True}),
    }
    verifying = {"stored": True, "screen": True}
    for rows in range(2, DRAFT_TOKENS + 2):  # the verifying step's sizes
        sides[f"{rows} rows"] = (fused.plan, fused.task_names, rows, verifying)
    times, tasks = _time_plans(fused, sides, split, args.rounds)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    fused.forget_rows()  # the table rows were written here, not by the runner
    while eng.has_unfinished_requests():
        eng.step()
    drafted, accepted = fused.drafted_tokens, fused.accepted_tokens
    tokens_per_verify = (fused.speculative_steps + accepted) / max(fused.speculative_steps, 1)
    verify_ms = medians[f"{num_rows} rows"]
    speculative_ms = (DRAFT_TOKENS * medians["draft"] + verify_ms) / tokens_per_verify
    doc = {
        "model": args.model, "rounds": args.rounds, "draft_tokens": DRAFT_TOKENS,
        "plan_ms": times, "medians_ms": medians,
        "run": {"tokens": args.max_tokens, "tok_s": round(num_run / run_s, 1),
                "drafted": drafted, "accepted": accepted,
                "acceptance": round(accepted / max(drafted, 1), 3),
                "tokens_per_verifying_step": round(tokens_per_verify, 2)},
        "per_token_ms": _per_token(medians["1 row"], speculative_ms),
        "tasks_ms": tasks,
    }  # fmt: skip
    r = doc["run"]
    _report(doc, f"greedy run: {r['accepted']}/{r['drafted']} drafts kept "
                 f"({r['acceptance']:.1%}), {r['tokens_per_verifying_step']} tokens a "
                 "verifying step")  # fmt: skip
    return doc


def _sampling(args, i: int):
    """The lookup run's params for prompt i: greedy, or sampled with a seed of its own."""
    from engine import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, seed=i, ignore_eos=not args.stop_at_eos)  # fmt: skip


def _wall_clock(args, eng, fused, prompts) -> dict:
    """The same prompts one at a time with the lookup on and off (`fused.lookup` set aside),
    alternating for `--wall-rounds`: tok/s each way, and that both gave the same tokens."""
    lookup, tok_s, same = fused.lookup, {"on": [], "off": []}, True
    outputs: dict[str, list] = {}
    for r in range(args.wall_rounds):
        for side in ("on", "off"):
            fused.lookup = lookup if side == "on" else None
            tokens, start = [], time.perf_counter()
            for i, prompt in enumerate(prompts):
                eng.add_request(f"wall{r}{side}{i}", prompt, _sampling(args, i))
                out: list[int] = []
                while eng.has_unfinished_requests():
                    out += [t for delta in eng.step() for t in delta.token_ids]
                tokens.append(out)
            tok_s[side].append(round(sum(map(len, tokens)) / (time.perf_counter() - start), 1))
            same = same and outputs.setdefault(side, tokens) == tokens
            same = same and outputs.get("on", tokens) == tokens
    fused.lookup = lookup
    ratios = [round(a / b, 3) for a, b in zip(tok_s["on"], tok_s["off"], strict=True)]
    return {"tok_s": tok_s, "on_over_off": ratios,
            "median_on_over_off": statistics.median(ratios), "same_tokens": same}  # fmt: skip


def _together(args, eng, fused) -> dict:
    """`--together N`: groups of N requests with `speculate_batch` on and off, ABBA."""
    from engine import fused_decode
    from loadtest.workloads import chat_prompts

    if fused.lookup is None:
        raise SystemExit("--together: the lookup verifies proposals of several requests only")
    prompts = chat_prompts(eng.tokenizer, args.num_prompts)
    on_max = fused_decode.BATCH_MAX_REQUESTS
    tok_s: dict[str, list[float]] = {"on": [], "off": []}
    outputs: dict[str, list] = {}
    kept = {"proposed": 0, "kept": 0, "steps": 0}
    try:
        for r in range(args.wall_rounds):
            for side in ("on", "off") if r % 2 == 0 else ("off", "on"):
                fused_decode.BATCH_MAX_REQUESTS = on_max if side == "on" else 1
                tokens: dict[str, list[int]] = {f"t{r}{side}{i}": [] for i in range(len(prompts))}
                ids = list(tokens)
                start = time.perf_counter()
                for first in range(0, len(prompts), args.together):
                    for i in range(first, min(first + args.together, len(prompts))):
                        eng.add_request(ids[i], prompts[i], _sampling(args, i))
                    while eng.has_unfinished_requests():
                        running = len(eng.scheduler.running)
                        before = (fused.drafted_tokens, fused.accepted_tokens)
                        steps = fused.speculative_steps
                        for delta in eng.step():
                            tokens[delta.request_id] += delta.token_ids
                        if side == "on" and running > 1 and fused.speculative_steps > steps:
                            kept["steps"] += 1
                            kept["proposed"] += fused.drafted_tokens - before[0]
                            kept["kept"] += fused.accepted_tokens - before[1]
                elapsed = time.perf_counter() - start
                tok_s[side].append(round(sum(map(len, tokens.values())) / elapsed, 1))
                outputs[side] = [tokens[i] for i in ids]
    finally:
        fused_decode.BATCH_MAX_REQUESTS = on_max
    ratios = [round(a / b, 3) for a, b in zip(tok_s["on"], tok_s["off"], strict=True)]
    same = sum(a == b for a, b in zip(outputs["on"], outputs["off"], strict=True))
    doc = {
        "model": args.model, "quantization": args.quantization, "together": args.together,
        "prompts": len(prompts), "max_tokens": args.max_tokens, "stop_at_eos": args.stop_at_eos,
        "temperature": args.temperature, "top_p": args.top_p, "tok_s": tok_s, "on_over_off": ratios, "median_on_over_off": statistics.median(ratios),
        "batch_steps": kept["steps"], "batch_proposed": kept["proposed"],
        "batch_kept": kept["kept"], "answers_the_same": same,
    }  # fmt: skip
    print(f"{args.together} requests at a time, {len(prompts)} prompts: tok/s with batch "
          f"verification {tok_s['on']}, without {tok_s['off']}; on/off {ratios}, median "
          f"{doc['median_on_over_off']:.3f}; {kept['kept']}/{kept['proposed']} proposals kept "
          f"in {kept['steps']} batch steps; {same}/{len(prompts)} answers the same")  # fmt: skip
    return doc


def _run_lookup(args, eng, fused) -> dict:
    """The lookup's side: the plan at 1 to lookup_tokens + 1 rows, alternating; a run over
    chat prompts (greedy or sampled: `--temperature`; ignore_eos as W1, or answers that end at
    EOS: `--stop-at-eos`) counting its steps by rows; the cost a token each way; then the same
    run's wall-clock with the lookup on and off (`--wall-rounds`)."""
    from engine import SamplingParams
    from loadtest.workloads import chat_prompts

    prompts = chat_prompts(eng.tokenizer, args.num_prompts)
    steps_by_rows: dict[int, int] = {}
    num_tokens = 0
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        eng.add_request(f"run{i}", prompt, _sampling(args, i))
        num_tokens += len(eng.step())  # the prompt and its first token
        while eng.has_unfinished_requests():  # decode steps
            drafted, steps = fused.drafted_tokens, fused.speculative_steps
            num_tokens += len(eng.step())
            rows = fused.drafted_tokens - drafted + 1 if fused.speculative_steps > steps else 1
            steps_by_rows[rows] = steps_by_rows.get(rows, 0) + 1
    run_s = time.perf_counter() - start
    proposed, kept = fused.drafted_tokens, fused.accepted_tokens
    # The plans, over the context of a request that has decoded a while (rows rewrite K/V
    # with the same bits).
    num_rows = fused.lookup_tokens + 1
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    eng.add_request("timed", prompts[0], params)
    request = eng.scheduler.requests["timed"]
    while request.num_output_tokens < args.max_tokens - 2 * num_rows:
        eng.step()
    split = _last_rows(eng, fused, "timed", num_rows)
    sides = {
        f"{rows} row{'s' * (rows > 1)}": (
            fused.plan, fused.task_names, rows, {"stored": rows > 1, "greedy": True, "head": True}
        )
        for rows in range(1, num_rows + 1)
    }
    times, tasks = _time_plans(fused, sides, split, args.rounds)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    fused.forget_rows()
    while eng.has_unfinished_requests():
        eng.step()
    by_rows = list(medians.values())
    decode_tokens = num_tokens - len(prompts)
    speculative_ms = sum(n * by_rows[r - 1] for r, n in steps_by_rows.items()) / decode_tokens
    doc = {
        "model": args.model, "quantization": args.quantization, "rounds": args.rounds,
        "stop_at_eos": args.stop_at_eos,
        "lookup_tokens": fused.lookup_tokens, "plan_ms": times, "medians_ms": medians,
        "run": {"prompts": len(prompts), "tokens": num_tokens,
                "tok_s": round(num_tokens / run_s, 1),
                "decode_steps_by_rows": dict(sorted(steps_by_rows.items())),
                "proposed": proposed, "kept": kept, "kept_share": round(kept / max(proposed, 1), 3),
                "decode_tokens_per_step": round(decode_tokens / sum(steps_by_rows.values()), 3)},
        "per_token_ms": _per_token(medians["1 row"], speculative_ms),
        "tasks_ms": tasks,
        "sampling": {"temperature": args.temperature, "top_p": args.top_p},
    }  # fmt: skip
    if args.wall_rounds:
        doc["wall_clock"] = _wall_clock(args, eng, fused, prompts)
    r = doc["run"]
    _report(doc, f"run ({r['prompts']} prompts, {r['tokens']} tokens): decode steps by "
                 f"rows {r['decode_steps_by_rows']}, {r['kept']}/{r['proposed']} proposals "
                 f"kept ({r['kept_share']:.1%}), {r['decode_tokens_per_step']} tokens a decode "
                 "step")  # fmt: skip
    return doc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--linear-kernel", default="auto", help="bf16 linears: auto|gemv|...")
    parser.add_argument("--quantization", default="",
                        help="'' (bf16: the draft) or int4/int8 (the lookup's proposals)")
    parser.add_argument("--num-prompts", type=int, default=8, help="the lookup's greedy run")
    parser.add_argument("--temperature", type=float, default=0.0, help="the lookup's run")
    parser.add_argument("--top-p", type=float, default=1.0, help="the lookup's run")
    parser.add_argument("--wall-rounds", type=int, default=3,
                        help="the lookup's run on and off, alternating (0: none)")
    parser.add_argument("--stop-at-eos", action="store_true",
                        help="the lookup's run ends each answer at EOS (W1 ignores it)")
    parser.add_argument("--together", type=int, default=0,
                        help="N requests decoding together: batch verification on and off")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    emit(run(args), args.out, None, None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
