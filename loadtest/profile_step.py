"""`mini-infer bench engine --profile`: where the wall-clock time of one decode step goes.

For W1 (1 request) and W2 (32 requests), once every request decodes, two passes:
1. wall clock (perf_counter, no profiler) around the step's parts: the scheduler, batch
   preparation, the model forward, the logits (lm_head), the sampler, the scheduler's update,
   post-processing (detokenizer, stop checks, deltas), the rest of the step; and inside the
   forward around every linear (GEMV/GEMM: the module call, our int4/int8 kernels included)
   and every attention call (cache store + paged attention). A decode-only step on the fused
   step has no batch preparation: the runner writes its inputs from the requests inside the
   same call (`ModelRunner._run_decodes`), timed as the forward;
2. torch.profiler over the forward: how many operators a step runs, and the self time of those
   that are neither a linear nor attention ("other operators": norms, rotary, SiLU, adds...).
"Python in forward" is what is left of the forward: the model's own Python and the dispatch
around each call. Pass 2 only splits pass 1's remainder of the forward (less linears and
attention) between operators and Python, by its own proportions: under load the two passes see
different machines (the table prints the load average). The profiler adds about a microsecond
to each operator it records, so the operators' share is a slight overestimate.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import defaultdict

NUM_STEPS = {"W1": 32, "W2": 8}
SECTIONS = ("schedule", "prepare", "forward", "logits", "sampler", "update", "postprocess")
KERNEL_LABELS = ("mini_infer::linear", "mini_infer::attention", "mini_infer::fused")


class _Timed:
    """Wraps a callable; adds its wall time to `totals[name]` on each call."""

    def __init__(self, fn, totals: dict[str, float], name: str):
        self.fn, self.totals, self.name = fn, totals, name

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.totals[self.name] += time.perf_counter() - start

    def __getattr__(self, attr):  # a wrapped object (the sampler) keeps its other methods
        return getattr(self.fn, attr)


def _instrument(eng, totals: dict[str, float]) -> None:
    runner = eng.runner
    eng.scheduler.schedule = _Timed(eng.scheduler.schedule, totals, "schedule")
    eng.scheduler.update_from_output = _Timed(eng.scheduler.update_from_output, totals, "update")
    eng._postprocess = _Timed(eng._postprocess, totals, "postprocess")
    runner._prepare = _Timed(runner._prepare, totals, "prepare")
    runner._forward = _Timed(runner._forward, totals, "forward")
    # A decode-only step on the fused step skips both: its inputs are written from the
    # requests and the step run in one call, counted as the forward (no "prepare").
    runner._run_decodes = _Timed(runner._run_decodes, totals, "forward")
    runner.model.compute_logits = _Timed(runner.model.compute_logits, totals, "logits")
    runner.sampler = _Timed(runner.sampler, totals, "sampler")


def _label_kernels(eng, totals: dict[str, float]) -> None:
    """Time every linear of the decoder layers (not the lm_head: "logits" times it) and every
    attention call, and run each under a named profiler range while a profiler records."""
    import torch

    def wrap(fn, name: str, label: str):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                if torch.autograd._profiler_enabled():
                    with torch.profiler.record_function(label):
                        return fn(*args, **kwargs)
                return fn(*args, **kwargs)
            finally:
                totals[name] += time.perf_counter() - start

        return timed

    for module in eng.runner.model.model.layers.modules():
        if type(module).__name__.endswith("Linear") and not list(module.children()):
            module.forward = wrap(module.forward, "gemm", "mini_infer::linear")
    backend = eng.runner.attention
    backend.forward = wrap(backend.forward, "attention", "mini_infer::attention")
    fused = getattr(eng.runner._forward, "fused", None)
    if fused is not None:  # the fused decode step: its one C++ call is all of the layers' kernels
        fused.plan = _TimedPlan(fused.plan, wrap(fused.plan.run, "fused_step", "mini_infer::fused"))


class _TimedPlan:
    """A fused decode plan whose run is timed (the C++ object's attributes cannot be replaced)."""

    def __init__(self, plan, run):
        self.plan, self.run = plan, run

    def stats(self):
        return self.plan.stats()


def _start(eng, num_requests: int, prompts: list[list[int]], max_tokens: int) -> None:
    from engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(num_requests):
        eng.add_request(f"p{i}", prompts[i % len(prompts)], params)
    while eng.scheduler.num_waiting or any(
        r.num_output_tokens < 2 for r in eng.scheduler.running
    ):  # past prefill: every request decoding
        eng.step()


def _operator_split(eng, num_steps: int) -> dict[str, float]:
    """Per step, inside the forward: operators run, and the self time (ms) of those outside the
    linears and attention."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    runner = eng.runner
    forward, run_decodes = runner._forward, runner._run_decodes

    class Recorded:
        """`fn` under the forward's profiler range; its other attributes as they are (the
        runner asks the fused step's forward for its logits and greedy ids)."""

        def __init__(self, fn):
            self.fn = fn

        def __call__(self, *args, **kwargs):
            with torch.profiler.record_function("mini_infer::forward"):
                return self.fn(*args, **kwargs)

        def __getattr__(self, attr):
            return getattr(self.fn, attr)

    runner._forward, runner._run_decodes = Recorded(forward), Recorded(run_decodes)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(num_steps):
            eng.step()
    runner._forward, runner._run_decodes = forward, run_decodes
    num_ops, other_us, forward_us, kernel_us = 0, 0.0, 0.0, 0.0
    for event in prof.events():
        if event.name == "mini_infer::forward":
            forward_us += event.cpu_time_total
            continue
        if event.name in KERNEL_LABELS:
            kernel_us += event.cpu_time_total
            continue
        parent, in_kernel = event.cpu_parent, False
        while parent is not None and parent.name != "mini_infer::forward":
            in_kernel = in_kernel or parent.name in KERNEL_LABELS
            parent = parent.cpu_parent
        if parent is not None:
            num_ops += 1
            if not in_kernel:
                other_us += event.self_cpu_time_total
    return {
        "num_ops": num_ops / num_steps,
        # Of the forward's time outside linears and attention, the operators' share.
        "other_ops_share": min(1.0, other_us / max(forward_us - kernel_us, 1e-9)),
    }


def profile_workload(eng, totals: dict, prompts, num_requests: int, num_steps: int) -> dict:
    """`eng` instrumented into `totals` (_instrument, _label_kernels)."""
    _start(eng, num_requests, prompts, max_tokens=16 + 4 * num_steps)
    totals.clear()
    step_times = []
    for _ in range(num_steps):
        start = time.perf_counter()
        eng.step()
        step_times.append(time.perf_counter() - start)
    wall = {k: totals[k] / num_steps * 1000 for k in (*SECTIONS, "gemm", "attention", "fused_step")}
    fused_tasks = _fused_task_split(eng, num_steps)
    ops = _operator_split(eng, num_steps)
    for request_id in [r.request_id for r in list(eng.scheduler.running)]:
        eng.abort_request(request_id)
    step_ms = sum(step_times) / num_steps * 1000
    # Pass 2 runs on another (profiled, perhaps busier) machine: it only splits pass 1's
    # remainder of the forward between operators and Python.
    remainder = wall["forward"] - wall["gemm"] - wall["attention"] - wall["fused_step"]
    inside = {"gemm": wall["gemm"], "attention": wall["attention"],
              "fused_step": wall["fused_step"],
              "other_ops": remainder * ops["other_ops_share"]}  # fmt: skip
    outside = {k: wall[k] for k in SECTIONS if k != "forward"}
    outside["rest_of_step"] = step_ms - sum(wall[k] for k in SECTIONS)
    breakdown = {
        **inside,
        "python_in_forward": wall["forward"] - sum(inside.values()),
        **{f"outside:{k}": v for k, v in outside.items()},
    }
    # (the fused decode step's one call counts whole: its kernels and the barrier waits between)
    kernels_ms = wall["gemm"] + wall["attention"] + wall["fused_step"] + wall["logits"]
    return {
        "step_ms": round(step_ms, 2),
        "step_ms_median": round(statistics.median(step_times) * 1000, 2),
        "forward_ms": round(wall["forward"], 2),
        "ops_per_step": round(ops["num_ops"], 1),
        # Kernels: the forward's linears and attention, and the lm_head (the logits).
        "outside_kernels_ms": round(step_ms - kernels_ms, 2),
        "breakdown_ms": {k: round(v, 3) for k, v in breakdown.items()},
        **({"fused_tasks_ms": fused_tasks} if fused_tasks else {}),
    }


def run_with_task_clocks(plan, names: list[str], run) -> tuple[object, list[tuple]]:
    """`run()` with a fused decode plan's per-task clocks on (decode_step.cpp `set_timing`):
    its result and, per task of the plan, (its name from `names`, each thread's ns working, each
    thread's ns waiting at the barrier after it); no tasks where every step ran on one thread.
    While the clocks run the thread choice is off: every step runs on all the threads."""
    plan.set_timing(True)
    try:
        result = run()
        work, wait = plan.task_times()
    finally:
        plan.set_timing(False)
    return result, list(zip(names, work, wait, strict=True)) if work else []


def _fused_task_split(eng, num_steps: int) -> dict | None:
    """Inside the fused decode call, per step and kind of task (summed over layers), in ms:
    each thread's time working and waiting at the barrier after, averaged over the threads.
    Timed in steps of their own (the clocks cost ~0.1 us a task)."""
    fused = getattr(eng.runner._forward, "fused", None)
    plan = getattr(fused, "plan", None)
    plan = getattr(plan, "plan", plan)  # under _TimedPlan
    if plan is None or not hasattr(plan, "set_timing"):
        return None
    _, tasks = run_with_task_clocks(plan, fused.task_names,
                                    lambda: [eng.step() for _ in range(num_steps)])  # fmt: skip
    if not tasks:  # every step ran on one thread (no barriers, no clocks)
        return None
    split = task_split(tasks, num_steps)
    return {k: {m: round(v, 3) for m, v in e.items()} for k, e in split.items()}


def task_split(tasks: list[tuple], num_steps: int) -> dict[str, dict[str, float]]:
    """`run_with_task_clocks`'s tasks by kind (their name), summed over the kind's tasks, in ms
    a step (or a run: `num_steps` divides): the threads' mean work, the slowest thread's work
    and the threads' mean wait at the barrier after."""
    split: dict[str, dict[str, float]] = {}
    for name, w, b in tasks:
        entry = split.setdefault(name, {"work": 0.0, "wait": 0.0, "max_work": 0.0})
        entry["work"] += sum(w) / len(w) / num_steps / 1e6
        entry["max_work"] += max(w) / num_steps / 1e6
        entry["wait"] += sum(b) / len(b) / num_steps / 1e6
    return split


def _plan_stats(eng) -> dict | None:
    """The fused decode plan's counters (steps, steps on one thread, barrier waits that slept)."""
    fused = getattr(eng.runner._forward, "fused", None)
    return None if fused is None else dict(fused.plan.stats())


def profile(
    model: str,
    dtype: str,
    quantization: str | None = None,
    workloads: tuple[str, ...] = ("W1", "W2"),
    compile_mode: str = "auto",
    out=None,
    fused_ops: str = "auto",
    fused_decode: str = "auto",
) -> int:
    import os

    import torch

    from engine import LLMEngine
    from engine.loader import load_tokenizer
    from loadtest.workloads import chat_prompts
    from loadtest.workloads import workloads as all_workloads

    # One-token steps: a step's parts, whatever speculative decoding would make of them (its
    # draft and verifying steps are timed by loadtest/bench_speculative.py).
    eng = LLMEngine(model, dtype=dtype, quantization=quantization, compile=compile_mode,
                    max_num_seqs=64, fused_ops=fused_ops,
                    fused_decode=fused_decode, speculative_decoding="off")  # fmt: skip
    totals: dict[str, float] = defaultdict(float)
    _instrument(eng, totals)
    _label_kernels(eng, totals)
    prompts = chat_prompts(load_tokenizer(eng.model_path), 32)
    results = {}
    for name in workloads:
        num_requests = all_workloads()[name].num_requests
        results[name] = profile_workload(eng, totals, prompts, num_requests, NUM_STEPS.get(name, 8))
    doc = {"model": model, "dtype": dtype, "quantization": quantization, "compile": compile_mode,
           "fused_ops": fused_ops, "pointwise_ops": eng.runner.pointwise_ops,
           "fused_decode": eng.runner.fused_decode or "on",
           "fused_decode_stats": _plan_stats(eng),
           "threads": torch.get_num_threads(), "load_average": os.getloadavg(),
           "results": results}  # fmt: skip
    print(f"\nper decode step, ms ({dtype}, quantization {quantization}, fused ops {fused_ops}, "
          f"fused decode {doc['fused_decode']}, wall clock; "
          f"load average {os.getloadavg()[0]:.1f})")  # fmt: skip
    print(f"{'part':28} " + " ".join(f"{w:>9}" for w in results))
    rows = [("step (mean)", "step_ms"), ("  forward", "forward_ms"), ("operators", "ops_per_step")]
    for label, key in rows:
        print(f"{label:28} " + " ".join(f"{r[key]:9.2f}" for r in results.values()))
    for key in next(iter(results.values()))["breakdown_ms"]:
        cells = " ".join(f"{r['breakdown_ms'][key]:9.2f}" for r in results.values())
        print(f"  {key:26} {cells}")
    for name, r in results.items():
        tasks = r.get("fused_tasks_ms")
        if not tasks:
            continue
        print(f"\n{name}: inside the fused call, ms per step (threads' mean work, slowest "
              "thread's work, mean wait at the barrier after)")  # fmt: skip
        for kind, e in tasks.items():
            print(f"  {kind:26} {e['work']:9.3f} {e['max_work']:9.3f} {e['wait']:9.3f}")
        total = {m: sum(e[m] for e in tasks.values()) for m in ("work", "max_work", "wait")}
        print(f"  {'total':26} {total['work']:9.3f} {total['max_work']:9.3f} {total['wait']:9.3f}")
    cells = " ".join(f"{r['outside_kernels_ms']:9.2f}" for r in results.values())
    print(f"{'outside kernels':28} {cells}   (step - linears - attention - fused step - lm_head)")
    print(json.dumps(doc, indent=2))
    if out:
        out.write_text(json.dumps(doc, indent=2))
    return 0
