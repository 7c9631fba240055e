"""Decode at long contexts: one stream's step time as its context grows, and the decode
attention kernel's at those lengths.

    python -m loadtest.bench_long_context [--rounds 3] [--contexts 32,256,512,1024,1536,1984]
        [--kernel-only] [--isa avx2|portable] [--baseline DIR] [--quantization int4]
        [--out r.json] [--plot r.png]

Two parts, each alternating its sides round by round (medians over rounds; ratios > 1: the
first side is faster):
- kernel: SmolLM2's decode attention shape (9 query heads, 3 KV heads, head_dim 64, bf16 cache,
  30 layers, one row). Each sample runs the 30 layers once after reading 64 MiB of other
  data, so the cache comes from memory as in a step, where the weights stream through the
  caches between layers; GB/s are K/V bytes read per second. `--isa avx2` (or portable)
  measures that build instead. With `--baseline DIR` this tree's build also runs against the
  baseline's, a fresh process per tree and round.
- engine (skipped with `--kernel-only`): one request of a 32-token prompt, generating to the
  longest context, greedy; the median step time in a window of 64 steps at each context
  length. With `--baseline DIR` the same run of another checkout alternates with this one,
  each in a fresh process (this script, the other checkout's `engine/` imported first), so a
  change is measured against the code before it in the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from loadtest.report import emit
from loadtest.trees import ROOT, alternate, print_result, sides_of

WINDOW = 64  # steps per context length's median
PROMPT_TOKENS = 32


def kernel_rounds(contexts: list[int], rounds: int, isa: str | None = None) -> dict:
    """Per context, the kernel's median ms ("ms") and the K/V GB/s it read ("gb_s")."""
    import torch

    from engine.kernels.cpu import paged_attention
    from engine.kv_pool import lazy_zeros

    ext = paged_attention.load() if isa is None else paged_attention.build(isa=isa)
    if ext is None:
        return {"skipped": f"the kernel did not build here (isa {isa or 'native'})"}
    layers, heads, kv_heads, head_dim, block = 30, 9, 3, 64, 16
    evict = torch.ones(64 << 20, dtype=torch.uint8)  # written once: its pages are real
    results = {}
    for ctx in contexts:
        blocks = -(-ctx // block)
        cache = lazy_zeros((layers, blocks, block, 2, kv_heads, head_dim), torch.bfloat16)
        cache.copy_(torch.randn(cache.shape).to(torch.bfloat16))
        table = torch.arange(blocks).view(1, blocks)
        lens = torch.tensor([ctx])
        q = torch.randn(1, heads, head_dim).to(torch.bfloat16)
        out = torch.empty_like(q)
        times = []
        for i in range(rounds * 5 + 2):  # two warm-up samples
            evict.view(torch.int64).sum()  # read, as the weights stream: no dirty lines
            start = time.perf_counter()
            for layer in range(layers):
                paged_attention.decode(ext, q, cache[layer], table, lens, out)
            if i >= 2:
                times.append(time.perf_counter() - start)
        nbytes = layers * ctx * kv_heads * head_dim * 2 * 2
        ms = round(statistics.median(times) * 1e3, 3)
        results[ctx] = {"ms": ms, "gb_s": round(nbytes / ms / 1e6, 1)}
    return {"threads": torch.get_num_threads(), "isa": isa or "native", "by_context": results}


def _alternate(part: str, sides: dict[str, Path], rounds: int, flags: list[str]) -> dict:
    """This script with `flags` in each side's tree in turn, `rounds` times: each side's
    results."""
    return alternate(__file__, sides, flags, rounds, timeout_s=1800, label=f"{part} ")


def kernel_against_baseline(args, contexts: list[int]) -> dict:
    """This tree's build against the baseline's, a fresh process per tree and round, trees
    alternating. (A baseline from before session 15 runs its default decode path.)"""
    sides = {"this": ROOT, "baseline": args.baseline.resolve()}
    flags = ["--child-kernel", "--contexts", ",".join(map(str, contexts))]
    flags += ["--isa", args.isa] if args.isa else []
    runs = {
        name: [r["by_context"] for r in rs]
        for name, rs in _alternate("kernel", sides, args.rounds, flags).items()
    }
    medians = {
        name: {ctx: statistics.median(r[str(ctx)]["ms"] for r in rs) for ctx in contexts}
        for name, rs in runs.items()
    }
    ratios = {ctx: round(medians["baseline"][ctx] / medians["this"][ctx], 2) for ctx in contexts}
    return {"runs": runs, "median_ms": medians, "baseline_over_this": ratios}


def _engine_child(args) -> None:
    from engine import LLMEngine, SamplingParams
    from loadtest.workloads import ENGINE_OPTIONS

    contexts = [int(c) for c in args.contexts.split(",")]
    engine = LLMEngine(args.model, quantization=args.quantization, **ENGINE_OPTIONS)
    engine.add_request("warmup", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    max_tokens = max(contexts) - PROMPT_TOKENS + WINDOW
    prompt = list(range(100, 100 + PROMPT_TOKENS))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request("long", prompt, params)
    stamps = []
    while engine.has_unfinished_requests():
        engine.step()
        stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]  # gap i: context ~ 32 + i
    by_context = {}
    for ctx in contexts:
        start = max(0, ctx - PROMPT_TOKENS)
        by_context[ctx] = round(statistics.median(gaps[start : start + WINDOW]) * 1e3, 3)
    print_result(by_context)


def engine_rounds(args, contexts: list[int]) -> dict:
    sides = sides_of(args.baseline)
    flags = ["--child", "--contexts", args.contexts, "--model", args.model]
    flags += ["--quantization", args.quantization] if args.quantization else []
    runs = {
        name: [{int(ctx): ms for ctx, ms in r.items()} for r in rs]
        for name, rs in _alternate("engine", sides, args.rounds, flags).items()
    }
    medians = {
        name: {ctx: statistics.median(r[ctx] for r in rs) for ctx in contexts}
        for name, rs in runs.items()
    }
    doc = {"runs": runs, "median_ms_per_step": medians}
    if args.baseline:
        doc["baseline_over_this"] = {
            ctx: round(medians["baseline"][ctx] / medians["this"][ctx], 2) for ctx in contexts
        }
    return doc


def _draw(doc: dict, plt):
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    kernel = doc.get("kernel", {}).get("by_context", {})
    if kernel:
        xs = sorted(kernel)
        axes[0].plot(xs, [kernel[x]["ms"] for x in xs], marker="o", label="this")
        against = doc.get("kernel_against_baseline", {}).get("median_ms", {}).get("baseline")
        if against:
            xs_base = sorted(against)
            axes[0].plot(xs_base, [against[x] for x in xs_base], marker="o", linestyle="--",
                         label="baseline")  # fmt: skip
        axes[0].set(title="decode attention, 30 layers, one row", xlabel="context tokens",
                    ylabel="ms")  # fmt: skip
        axes[0].legend()
    engine = doc.get("engine", {}).get("median_ms_per_step", {})
    for name, by_ctx in engine.items():
        xs = sorted(by_ctx)
        axes[1].plot(xs, [by_ctx[x] for x in xs], marker="o", label=name)
    axes[1].set(title="engine step, one stream", xlabel="context tokens", ylabel="ms per step")
    if engine:
        axes[1].legend()
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--contexts", default="32,256,512,1024,1536,1984")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--quantization", default="int4", help="engine weights ('' for bf16)")
    parser.add_argument("--kernel-only", action="store_true")
    parser.add_argument("--isa", help="the kernel part on this build (avx2, portable) instead")
    parser.add_argument("--baseline", type=Path, help="another checkout's engine to compare")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-kernel", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.quantization = args.quantization or None
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.child:
        _engine_child(args)
        return 0
    if args.child_kernel:
        print_result(kernel_rounds(contexts, 1, args.isa))
        return 0
    doc: dict = {"contexts": contexts, "rounds": args.rounds, "load_before": os.getloadavg()[0]}
    doc["kernel"] = kernel_rounds(contexts, args.rounds, args.isa)
    if args.baseline:
        doc["kernel_against_baseline"] = kernel_against_baseline(args, contexts)
    if not args.kernel_only:
        doc["engine"] = engine_rounds(args, contexts)
    doc["load_after"] = os.getloadavg()[0]
    kernel = doc["kernel"].get("by_context", {})
    if kernel:
        print(f"kernel ({doc['kernel']['isa']} build), ms and GB/s of K/V:")
        print(f"{'context':>8} {'ms':>9} {'GB/s':>6}")
        for ctx, row in kernel.items():
            print(f"{ctx:>8} {row['ms']:>9.3f} {row['gb_s']:>6.1f}")
    else:
        print(f"kernel: {doc['kernel'].get('skipped')}")
    if "kernel_against_baseline" in doc:
        against = doc["kernel_against_baseline"]
        print("kernel, this build against the baseline's (fresh processes), ms:")
        print(f"{'context':>8} {'this':>9} {'baseline':>9} {'ratio':>6}")
        for ctx in contexts:
            this, base = against["median_ms"]["this"][ctx], against["median_ms"]["baseline"][ctx]
            ratio = against["baseline_over_this"][ctx]
            print(f"{ctx:>8} {this:>9.3f} {base:>9.3f} {ratio:>6.2f}")
    if "engine" in doc:
        medians = doc["engine"]["median_ms_per_step"]
        print(f"{'context':>8} " + " ".join(f"{name + ' ms':>13}" for name in medians)
              + (f" {'ratio':>6}" if args.baseline else ""))  # fmt: skip
        for ctx in contexts:
            line = f"{ctx:>8} " + " ".join(f"{m[ctx]:>13.3f}" for m in medians.values())
            if args.baseline:
                line += f" {doc['engine']['baseline_over_this'][ctx]:>6.2f}"
            print(line)
    emit(doc, args.out, args.plot, lambda plt: _draw(doc, plt))
    return 0


if __name__ == "__main__":
    sys.exit(main())
