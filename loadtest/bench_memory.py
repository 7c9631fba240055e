"""Peak RSS and throughput of the engine process at W2, one code tree against another, in one
run (issue 17's memory target: int4 weights + the int8 KV cache).

    python loadtest/bench_memory.py [--baseline /path/to/other/checkout] [--rounds 3]
        [--options '{"dtype": "bfloat16", "quantization": "int4", "kv_cache_dtype": "int8"}']
        [--llama-server path/to/llama-server] [--out r.json]

Each (tree, round) runs in its own process (`python -m loadtest.bench_memory --child` with that
tree first on PYTHONPATH), so its peak RSS (`ru_maxrss`) is its own: load the default model with
`--options`, run W2 (32 chat prompts submitted together, 128 tokens each, EOS ignored), report
RSS after each stage (import, weights, KV pool, load, warm-up, W2), peak RSS and tokens/s. Trees alternate round by round; the table gives medians
and this tree's ratio to the baseline (and to llama-server on the same GGUF and prompts, its
own -np 32, with `--llama-server`). The machine is shared: `uptime` is recorded beside.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
DEFAULT_OPTIONS = {"dtype": "bfloat16", "quantization": "int4", "kv_cache_dtype": "int8"}


def _memory_status() -> dict[str, float]:
    """MiB from /proc/self/status: VmRSS (now), VmHWM (peak so far), RssAnon (heap, torch's
    operator tables, tensors), RssFile (mapped libraries and files, the GGUF included)."""
    out = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = round(int(value.split()[0]) / 1024, 1)
    return out


STAGES = ("import", "weights", "kv_pool", "load", "warm_up", "w2")


def child(model: str, options: dict, num_requests: int, max_tokens: int) -> dict:
    """Run W2 in this process; RSS at each stage: after `import` (torch, transformers, the
    engine), after the `weights` are loaded and packed, after the `kv_pool` is allocated, after
    the whole `load` (tokenizer, engine), after a `warm_up` request and at the end of `w2`
    (`peak_rss_mib`: the peak over the whole process)."""
    stages = {}
    from engine import LLM, SamplingParams
    from engine.model_runner import ModelRunner
    from loadtest.workloads import chat_prompts

    stages["import"] = _memory_status()
    allocate = ModelRunner._allocate_kv_cache

    def allocate_and_record(runner):  # weights are in and packed when the pool is allocated
        stages["weights"] = _memory_status()
        allocate(runner)
        stages["kv_pool"] = _memory_status()

    ModelRunner._allocate_kv_cache = allocate_and_record
    start = time.perf_counter()
    llm = LLM(model, **options)
    load_s = time.perf_counter() - start
    stages["load"] = _memory_status()
    prompts = chat_prompts(llm.tokenizer, num_requests)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    stages["warm_up"] = _memory_status()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    stages["w2"] = _memory_status()
    return {
        "load_s": round(load_s, 2),
        "rss_after_load_mib": stages["load"]["VmRSS"],
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "tokens_per_s": round(sum(len(o.token_ids) for o in outs) / elapsed, 1),
        "num_kv_blocks": llm.engine.runner.num_kv_blocks,
        "kv_cache_bytes": llm.engine.runner.kv_cache_bytes,
        **{f"rss_{stage}_mib": stages[stage]["VmRSS"] for stage in STAGES if stage in stages},
        "rss_load_peak_mib": stages["load"]["VmHWM"],  # the peak while loading
        "stages": stages,
    }


def run_llama_server(args) -> dict:
    """`llama_server_child` in a process of its own: this one never imports torch, whose
    library pages it would then share with the engine children's (the engine pages its out
    of RSS, engine/library_pages.py, and the kernel skips pages another process maps)."""
    cmd = [sys.executable, "-m", "loadtest.bench_memory", "--llama-child", "--model", args.model,
           "--num-requests", str(args.num_requests), "--max-tokens", str(args.max_tokens),
           "--llama-server", str(args.llama_server)]  # fmt: skip
    return _child_result(cmd, HERE)


def llama_server_child(args) -> dict:
    """llama.cpp's llama-server on the same GGUF and W2 (its own -np 32 slots): its peak RSS."""
    from engine.loader import gguf_source, load_tokenizer, resolve_model
    from loadtest.llamacpp_peer import run_llamacpp
    from loadtest.workloads import chat_prompts

    model_path = resolve_model(args.model)
    prompts = chat_prompts(load_tokenizer(model_path), args.num_requests)
    result = run_llamacpp(
        args.llama_server, gguf_source(model_path), prompts, [args.max_tokens] * len(prompts)
    )
    return {"peak_rss_mib": result["server_peak_rss_mib"], "tokens_per_s": result["tokens_per_s"]}


def run_tree(tree: Path, args) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_WAIT_POLICY": "PASSIVE"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--model", args.model,
           "--options", json.dumps(args.options), "--num-requests", str(args.num_requests),
           "--max-tokens", str(args.max_tokens)]  # fmt: skip
    # Run as a script: sys.path[0] is loadtest/, then PYTHONPATH, so `engine` is `tree`'s.
    return _child_result(cmd, tree, env)


def _child_result(cmd: list[str], cwd: Path, env: dict | None = None) -> dict:
    """Run a child of this bench; the JSON on its last line of output, or its error."""
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": done.stderr[-800:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, help="the other checkout (its root)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--options", type=json.loads, default=DEFAULT_OPTIONS)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--llama-server", type=Path, default=None, help="also llama-server")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--llama-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.child:
        result = child(args.model, args.options, args.num_requests, args.max_tokens)
        print(json.dumps(result), flush=True)
        return 0
    if args.llama_child:
        print(json.dumps(llama_server_child(args)), flush=True)
        return 0
    trees = {"this": HERE}
    if args.baseline is not None:  # (optional: against llama-server alone, no other tree)
        trees = {"baseline": args.baseline.resolve(), **trees}
    if args.llama_server is not None:
        trees["llama-server"] = args.llama_server
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    uptime = [_uptime()]
    for round_index in range(args.rounds):
        for name, tree in trees.items():
            try:
                result = run_llama_server(args) if name == "llama-server" else run_tree(tree, args)
            except Exception as error:  # one side failing keeps the others' numbers
                result = {"error": repr(error)[-500:]}
            print(f"[memory] round {round_index} {name}: {result}", file=sys.stderr, flush=True)
            runs[name].append(result)
    uptime.append(_uptime())
    medians = {name: _medians(r) for name, r in runs.items()}
    doc = {"options": args.options, "trees": {k: str(v) for k, v in trees.items()},
           "uptime": uptime, "runs": runs, "medians": medians,
           "ratio_this_to_baseline": _ratios(medians)}  # fmt: skip
    print(_table(medians))
    text = json.dumps(doc, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


KEYS = ("rss_after_load_mib", "peak_rss_mib", "tokens_per_s", "load_s")
STAGE_KEYS = tuple(f"rss_{stage}_mib" for stage in STAGES) + ("rss_load_peak_mib",)


def _medians(runs: list[dict]) -> dict:
    ok = [r for r in runs if "error" not in r]
    keys = [key for key in KEYS + STAGE_KEYS if ok and all(key in r for r in ok)]
    return {key: round(statistics.median(r[key] for r in ok), 1) for key in keys}


def _ratios(medians: dict) -> dict:
    this = medians.get("this") or {}
    out = {}
    for other in ("baseline", "llama-server"):
        base = medians.get(other) or {}
        out[other] = {k: round(this[k] / base[k], 3) for k in KEYS if k in this and k in base}
    return out


def _table(medians: dict) -> str:
    """Medians per tree; then the engine's RSS (MiB) after each stage (see `child`)."""
    lines = [f"{'tree':12} " + " ".join(f"{k:>20}" for k in KEYS)]
    for name, m in medians.items():
        lines.append(f"{name:12} " + " ".join(f"{m.get(k, float('nan')):>20}" for k in KEYS))
    columns = STAGES + ("load peak", "peak")
    lines += ["", f"{'RSS MiB at':12} " + " ".join(f"{stage:>9}" for stage in columns)]
    for name, m in medians.items():
        if name == "llama-server":
            continue
        cells = [m.get(k, float("nan")) for k in STAGE_KEYS + ("peak_rss_mib",)]
        lines.append(f"{name:12} " + " ".join(f"{cell:>9}" for cell in cells))
    return "\n".join(lines)


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
