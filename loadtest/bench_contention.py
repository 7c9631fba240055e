"""What a worker's event loop costs the engine beside it: the GIL, or the cores?

The engine decodes a workload in a thread (as in the worker) while a competitor does pure
Python work for `duty` of every 10 ms, either in another thread of the engine's process (it
takes a core and the GIL, as the worker's event loop does) or in another process (it takes a
core only). If the thread costs clearly more than the process, the GIL is the loss and moving
the engine loop into a process of its own (vLLM's engine-core split) would win it back; if they
cost the same, the loss is the cores the two share, and only less work beside the engine helps.
Each competitor runs at nice 0, and at nice 19 (`-nice19`: the worker's event loop's default,
`event_loop_nice`). Modes alternate in fresh processes for `--rounds` rounds; medians and
ratios against the run with no competitor are printed, then the JSON. Not a test: the numbers
go in loadtest/JOURNAL.md.

    python -m loadtest.bench_contention [--quantization int4] [--workload W2] [--duties 0.1,0.2]
                                        [--modes thread,process] [--rounds 3] [--out r.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from loadtest.report import emit

PERIOD_S = 0.010
MODES = ("thread", "process", "thread-nice19", "process-nice19")


def compete(duty: float, stop: float, niceness: int = 0) -> None:
    """Pure Python arithmetic for `duty` of every PERIOD_S until the monotonic time `stop`, at
    `niceness` (this thread only, as the worker lowers its event loop's thread)."""
    if niceness:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
    work = duty * PERIOD_S
    while time.monotonic() < stop:
        start = time.perf_counter()
        count = 0
        while time.perf_counter() - start < work:
            count += 1
        time.sleep(max(0.0, PERIOD_S - work))


def child(mode: str, duty: float, workload: str, quantization: str | None) -> dict:
    """One measured run in this process: the engine in a thread, the competitor as `mode`."""
    from engine import LLMEngine, SamplingParams
    from engine.loader import load_tokenizer
    from loadtest.workloads import ENGINE_OPTIONS, chat_prompts

    options = dict(ENGINE_OPTIONS)
    if quantization:
        options["quantization"] = quantization
    engine = LLMEngine("smollm2-135m", **options)
    n = {"W1": 1, "W2": 32}[workload]
    prompts = chat_prompts(load_tokenizer(Path(engine.model_path)), n)
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    result: dict = {}

    def decode() -> None:
        engine.add_request("warm-up", prompts[0], SamplingParams(max_tokens=4, temperature=0.0))
        while engine.has_unfinished_requests():
            engine.step()
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        num_tokens, start = 0, time.perf_counter()
        while engine.has_unfinished_requests():
            num_tokens += sum(len(d.token_ids) for d in engine.step())
        result["tokens_per_s"] = num_tokens / (time.perf_counter() - start)

    stop = time.monotonic() + 600
    kind, _, nice = mode.partition("-nice")
    competing = (duty, stop, int(nice or 0))
    competitor = None
    if kind == "thread":
        competitor = threading.Thread(target=compete, args=competing, daemon=True)
    elif kind == "process":
        competitor = mp.get_context("spawn").Process(target=compete, args=competing)
    if competitor is not None:
        competitor.start()
    runner = threading.Thread(target=decode, name="engine")
    runner.start()
    runner.join()
    if kind == "process":
        competitor.terminate()
        competitor.join()
    return {"mode": mode, "duty": duty, **result}


def run_child(mode: str, duty: float, args) -> dict:
    cmd = [sys.executable, "-m", "loadtest.bench_contention", "--child", mode, str(duty),
           "--workload", args.workload]  # fmt: skip
    if args.quantization:
        cmd += ["--quantization", args.quantization]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=("W1", "W2"), default="W2")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--duties", default="0.1,0.2", help="competitor's busy fractions")
    parser.add_argument("--modes", default=",".join(MODES), help="competitors, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", nargs=2, metavar=("MODE", "DUTY"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        mode, duty = args.child
        print(json.dumps(child(mode, float(duty), args.workload, args.quantization)), flush=True)
        return 0
    duties = [float(d) for d in args.duties.split(",")]
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        parser.error(f"unknown modes {sorted(unknown)}; known: {', '.join(MODES)}")
    sides = [("none", 0.0)] + [(m, d) for d in duties for m in modes]
    runs: dict[str, list[float]] = {f"{m}@{d}": [] for m, d in sides}
    for r in range(args.rounds):
        for mode, duty in sides:
            rate = run_child(mode, duty, args)["tokens_per_s"]
            runs[f"{mode}@{duty}"].append(round(rate, 1))
            print(f"round {r + 1}/{args.rounds} {mode:8s} duty {duty:.2f}: {rate:7.1f} tok/s",
                  file=sys.stderr, flush=True)  # fmt: skip
    base = statistics.median(runs["none@0.0"])
    summary = {}
    print(f"\n{'competitor':24s}{'median tok/s':>14s}{'vs none':>10s}")
    for key, rates in runs.items():
        median = statistics.median(rates)
        summary[key] = {"median_tokens_per_s": round(median, 1), "vs_none": round(median / base, 3)}
        print(f"{key:24s}{median:14.1f}{median / base:10.3f}")
    doc = {"workload": args.workload, "quantization": args.quantization,
           "period_s": PERIOD_S, "rounds": args.rounds, "runs": runs, "summary": summary}  # fmt: skip
    emit(doc, args.out, None, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
