"""W1 (one chat request, 128 new tokens) on the 1B-shaped benchmark model: the engine's bf16
paths against llama.cpp's F16, rounds alternating, medians, and the weight bytes each streams.

    python -m loadtest.make_bench_model --out DIR    # once
    python -m loadtest.bench_1b --model DIR [--sides gemv,packed,llamacpp] [--rounds 3]
        [--gguf DIR/gguf/bench-1b-F16.gguf] [--llama-server BIN] [--json out.json]

Sides: "gemv" / "packed" / "plain" / "auto" are the engine in bf16 with that `linear_kernel`
(gemv: our kernel, engine/kernels/cpu/bf16_gemm.py; packed: oneDNN's; auto: the calibrated
choice); "int4" the engine with int4 weights (group 32, the checkpoint quantized once and
cached); "llamacpp" is `llama-server` on the F16 GGUF and "llamacpp-q4" on a Q4_1 one
(`--gguf-q4`; made with the peer build's `llama-quantize F16.gguf Q4_1.gguf Q4_1`), each with
`-t 2 -tb 2` and started with
OMP_WAIT_POLICY removed from its environment: ggml's threads are OpenMP threads too, and the
PASSIVE the engine sets would halve its speed). Each side runs in its own process each round.
The ratios are of wall-clock tok/s (both sides: 128 tokens after a ~40-token prompt, its
prefill included), and of decode speeds: the engine's tokens after its first over the time
after it, llama.cpp's own `timings.predicted_per_second` (report.decode_speed). GB/s =
tokens/s x the weight bytes one decode step of that side reads (every linear and the tied
lm_head): 16-bit sides 2 bytes a weight (2.15 GB here); "int4" the engine's layout, 4-bit
codes with an fp16 scale and minimum per 32 (0.625 bytes a weight) and its int8 lm_head (1
byte a weight and an fp32 scale a row); the llama.cpp sides the GGUF's tensors (Q4_1's output
tensor is Q6_K: 0.82 bytes a weight).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

from loadtest.report import decode_speed

ENGINE_SIDES = ("gemv", "packed", "plain", "auto", "int4")


def weight_bytes_per_token(config: dict) -> int:
    """Bytes of 16-bit weights one decode step reads: every linear plus the lm_head."""
    hidden, ffn = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * ffn
    return 2 * (config["num_hidden_layers"] * per_layer + config["vocab_size"] * hidden)


def int4_bytes_per_token(config: dict) -> int:
    """Bytes the engine's int4 step reads: the linears' 4-bit codes with an fp16 scale and
    minimum per group of 32 (20 bytes a group), the lm_head's int8 codes and fp32 row scales."""
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    linear_weights = weight_bytes_per_token(config) // 2 - vocab * hidden
    return linear_weights // 32 * 20 + vocab * (hidden + 4)


def gguf_bytes(path: Path) -> int | None:
    """The bytes of a GGUF's tensors (what llama.cpp streams a token: the tied token_embd is
    its output matrix); None without the `gguf` package or the file."""
    try:
        from gguf import GGUFReader

        return sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors)
    except (ImportError, OSError, ValueError):
        return None


def _child(side: str, spec: dict, q) -> None:
    try:
        from engine.loader import load_tokenizer
        from loadtest.workloads import ENGINE_OPTIONS, chat_prompts

        prompts = chat_prompts(load_tokenizer(Path(spec["model"])), 1)
        if side.startswith("llamacpp"):
            os.environ.pop("OMP_WAIT_POLICY", None)  # the server inherits our environment
            from loadtest.llamacpp_peer import run_llamacpp

            gguf = spec["gguf_q4"] if side == "llamacpp-q4" else spec["gguf"]
            result = run_llamacpp(Path(spec["llama_server"]), Path(gguf), prompts,
                                  [spec["max_tokens"]])  # fmt: skip
        else:
            from loadtest.bench_engine import run_engine

            options = {**ENGINE_OPTIONS, "compile": "off"}
            if side == "int4":
                options["quantization"] = "int4"
            else:
                options["linear_kernel"] = side
            result = run_engine(spec["model"], "bfloat16", prompts, spec["max_tokens"],
                                **options)  # fmt: skip
        q.put(result)
    except Exception as error:  # reported, not raised: the parent must not hang on the queue
        q.put({"error": repr(error)[-500:]})


def measure(side: str, spec: dict) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_child, args=(side, spec, q))
    proc.start()
    while True:
        try:
            out = q.get(timeout=5)
            break
        except Exception:
            if not proc.is_alive():
                return {"error": f"child exited with {proc.exitcode}"}
    proc.join()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_1b")
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--gguf", type=Path, default=None)
    parser.add_argument("--gguf-q4", type=Path, default=None, help="Q4_1 GGUF (llamacpp-q4)")
    parser.add_argument("--llama-server", default=None)
    parser.add_argument("--sides", default="gemv,packed,llamacpp")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    from loadtest.llamacpp_peer import find_server, missing_message

    sides = args.sides.split(",")
    spec = {"model": str(args.model), "max_tokens": args.max_tokens,
            "gguf": str(args.gguf or args.model / "gguf" / "bench-1b-F16.gguf"),
            "gguf_q4": str(args.gguf_q4 or args.model / "gguf" / "bench-1b-Q4_1.gguf")}  # fmt: skip
    if any(side.startswith("llamacpp") for side in sides):
        server = find_server(args.llama_server)
        if server is None:
            print(missing_message(), file=sys.stderr)
            sides = [side for side in sides if not side.startswith("llamacpp")]
        else:
            spec["llama_server"] = str(server)
    config = json.loads((args.model / "config.json").read_text())
    nbytes = weight_bytes_per_token(config)
    side_bytes = {"int4": int4_bytes_per_token(config), "llamacpp": gguf_bytes(Path(spec["gguf"])),
                  "llamacpp-q4": gguf_bytes(Path(spec["gguf_q4"]))}  # fmt: skip
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    loads = [os.getloadavg()[0]]
    for round_index in range(args.rounds):
        for side in sides:
            result = measure(side, spec)
            runs[side].append(result)
            decode = decode_speed(result) if "tokens_per_s" in result else None
            print(f"round {round_index + 1} {side:11} "
                  f"{result.get('tokens_per_s', result.get('error'))} tok/s "
                  f"{f'(decode {decode}) ' if decode else ''}"
                  f"load {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
            loads.append(os.getloadavg()[0])
    summary = {}
    for side, results in runs.items():
        speeds = [r["tokens_per_s"] for r in results if "tokens_per_s" in r]
        decode = [d for r in results if "tokens_per_s" in r and (d := decode_speed(r))]
        if speeds:
            median, read = statistics.median(speeds), side_bytes.get(side) or nbytes
            summary[side] = {"tokens_per_s": speeds, "median": median, "bytes_per_token": read,
                             "gb_s": round(median * read / 1e9, 1)}  # fmt: skip
            if decode:
                decode_median = statistics.median(decode)
                summary[side].update(decode_tokens_per_s=decode, decode_median=decode_median,
                                     decode_gb_s=round(decode_median * read / 1e9, 1))  # fmt: skip
    bases = {side: summary.get(side, {}) for side in ("llamacpp", "llamacpp-q4")}
    print(f"\nW1 1x{args.max_tokens}, {nbytes / 1e9:.2f} GB of 16-bit weights per token, "
          f"load average {min(loads):.1f}-{max(loads):.1f}")  # fmt: skip
    print(f"{'side':14} {'tok/s (rounds)':>28} {'median':>7} {'GB/tok':>6} {'GB/s':>6} "
          f"{'vs llama.cpp':>12}")  # fmt: skip
    for side, s in summary.items():
        # int4 against Q4_1, everything else against F16
        base = bases["llamacpp-q4" if side in ("int4", "llamacpp-q4") else "llamacpp"]
        for label, key, gb_s in (("", "", "gb_s"), ("  decode", "decode_", "decode_gb_s")):
            if f"{key}median" not in s:
                continue
            median = s[f"{key}median"]
            ratio = f"{median / base[f'{key}median']:.2f}x" if base.get(f"{key}median") else "-"
            rounds = ", ".join(f"{v:.1f}" for v in s[f"{key}tokens_per_s"])
            print(f"{label or side:14} {rounds:>28} {median:7.1f} "
                  f"{s['bytes_per_token'] / 1e9:6.3f} {s[gb_s]:6.1f} {ratio:>12}")  # fmt: skip
    doc = {"workload": "W1", "max_tokens": args.max_tokens, "weight_bytes_per_token": nbytes,
           "load_average": loads, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "summary": summary, "runs": runs}  # fmt: skip
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
