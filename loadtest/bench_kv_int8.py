"""The int8 KV cache read by the C++ decode kernel against the torch reference (gather,
dequantize, SDPA), in the engine: W1 (1 x 128) and W2 (32 x 128) tok/s, bf16 weights, each
backend in a fresh process, alternating rounds, medians.

    python -m loadtest.bench_kv_int8 [--rounds 2] [--out r.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from loadtest.report import emit

CHILD = """
import json, sys
from engine.loader import load_tokenizer, resolve_model
from loadtest.bench_engine import run_engine
from loadtest.workloads import chat_prompts
prompts = chat_prompts(load_tokenizer(resolve_model("smollm2-135m")), 32)
options = {"kv_cache_dtype": "int8", "attention_backend": sys.argv[1]}
print(json.dumps({name: run_engine("smollm2-135m", "bfloat16", prompts[:n], 128, **options)
                  ["tokens_per_s"] for name, n in (("W1", 1), ("W2", 32))}))
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    runs: dict[str, list[dict]] = {"torch": [], "cpu": []}
    for round_index in range(args.rounds):
        for backend in runs:
            print(f"[bench] round {round_index + 1}: {backend}", file=sys.stderr, flush=True)
            done = subprocess.run([sys.executable, "-c", CHILD, backend], check=True,
                                  capture_output=True, text=True)  # fmt: skip
            runs[backend].append(json.loads(done.stdout.strip().splitlines()[-1]))
    medians = {b: {w: statistics.median(r[w] for r in rs) for w in ("W1", "W2")}
               for b, rs in runs.items()}  # fmt: skip
    doc = {"rounds": args.rounds, "runs": runs, "medians": medians,
           "kernel_over_reference": {w: round(medians["cpu"][w] / medians["torch"][w], 2)
                                     for w in ("W1", "W2")}}  # fmt: skip
    print(f"{'backend':10} {'W1':>8} {'W2':>8}  (tok/s, medians)", file=sys.stderr)
    for backend, med in medians.items():
        print(f"{backend:10} {med['W1']:8.1f} {med['W2']:8.1f}", file=sys.stderr)
    emit(doc, args.out, None, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
