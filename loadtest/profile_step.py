"""`mini-infer bench engine --profile`: what one decode step runs, eager against compiled.

For each mode it decodes a batch of 32 requests, records a few steps with torch.profiler and
prints the operators per step (how many, and the top ones by self time) and the split of the
step's self time between GEMMs, attention and the rest. Fewer operators per step in the
compiled column is the fusion: the elementwise chains between GEMMs become one generated loop.
"""

from __future__ import annotations

from collections import defaultdict

NUM_REQUESTS = 32
NUM_STEPS = 5
GEMM_MARKERS = ("linear", "mm", "matmul", "mkldnn", "mkl_", "gemm")
ATTENTION_MARKERS = ("paged_attention", "scaled_dot_product", "index_select", "index_copy")


def category(name: str) -> str:
    lowered = name.lower()
    if any(m in lowered for m in ATTENTION_MARKERS):
        return "attention"
    if any(m in lowered for m in GEMM_MARKERS):
        return "gemm"
    return "rest"


def profile_mode(model: str, dtype: str, compile_mode: str) -> dict:
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from engine import LLMEngine, SamplingParams

    eng = LLMEngine(model, dtype=dtype, compile=compile_mode, max_num_seqs=64)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for i in range(NUM_REQUESTS):
        eng.add_request(str(i), [1 + (i * 7 + j) % 1000 for j in range(24)], params)
    for _ in range(4):  # past prefill: every request decoding
        eng.step()
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(NUM_STEPS):
            eng.step()
    # Leaf operators only (self time): the kernels that ran, not the wrappers around them.
    ops: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for event in prof.key_averages():
        if event.self_cpu_time_total <= 0:
            continue
        ops[event.key][0] += event.count
        ops[event.key][1] += event.self_cpu_time_total
    split: dict[str, float] = defaultdict(float)
    for name, (_, self_us) in ops.items():
        split[category(name)] += self_us
    total = sum(split.values())
    top = sorted(ops.items(), key=lambda kv: -kv[1][1])[:12]
    return {
        "ops_per_step": round(sum(c for c, _ in ops.values()) / NUM_STEPS, 1),
        "step_ms": round(total / NUM_STEPS / 1000, 2),
        "split_pct": {k: round(100 * v / total, 1) for k, v in sorted(split.items())},
        "top": [
            (name, round(c / NUM_STEPS, 1), round(us / NUM_STEPS / 1000, 3))
            for name, (c, us) in top
        ],
        "threads": torch.get_num_threads(),
    }


def profile(model: str, dtype: str) -> int:
    results = {mode: profile_mode(model, dtype, mode) for mode in ("off", "on")}
    for mode, r in results.items():
        label = "compiled" if mode == "on" else "eager"
        print(f"\n== {label} ({dtype}, {NUM_REQUESTS} decoding requests) ==")
        print(f"operators per step: {r['ops_per_step']}, self CPU time per step {r['step_ms']} ms")
        print("time split: " + ", ".join(f"{k} {v}%" for k, v in r["split_pct"].items()))
        print(f"{'operator':48} {'calls/step':>10} {'ms/step':>8}")
        for name, calls, ms in r["top"]:
            print(f"{name[:48]:48} {calls:10} {ms:8.3f}")
    return 0
