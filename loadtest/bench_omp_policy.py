"""The OpenMP wait policy's cost: engine tok/s under OMP_WAIT_POLICY=PASSIVE against ACTIVE.

libgomp reads the policy once, when torch loads it, so each measurement is a fresh process
(the bench engine child, spawned with the policy in its environment); the policies alternate
for `--rounds` rounds and the medians and their ratio (PASSIVE / ACTIVE) are printed. Not a
test: the numbers go in engine/openmp.py and loadtest/README.md.

    python -m loadtest.bench_omp_policy --dtype bfloat16 --workloads W1,W2 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from loadtest.bench_engine import measure

POLICIES = ("PASSIVE", "ACTIVE")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--workloads", default="W1,W2")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)

    from engine.loader import resolve_model

    names = args.workloads.split(",")
    spec = {"model": args.model, "model_path": str(resolve_model(args.model)),
            "dtype": args.dtype, "max_tokens": args.max_tokens, "workloads": names,
            "compile": "auto", "quantization": None}  # fmt: skip
    runs: dict[str, list[dict]] = {policy: [] for policy in POLICIES}
    saved = os.environ.get("OMP_WAIT_POLICY")
    try:
        for round_index in range(args.rounds):
            for policy in POLICIES:
                os.environ["OMP_WAIT_POLICY"] = policy  # inherited by the spawned child
                print(f"[omp] round {round_index + 1}: {policy} ...", file=sys.stderr, flush=True)
                runs[policy].append(measure("engine", spec)["results"])
    finally:
        if saved is None:
            os.environ.pop("OMP_WAIT_POLICY", None)
        else:
            os.environ["OMP_WAIT_POLICY"] = saved
    medians = {
        policy: {w: statistics.median(r[w]["tokens_per_s"] for r in results) for w in names}
        for policy, results in runs.items()
    }
    ratios = {w: round(medians["PASSIVE"][w] / medians["ACTIVE"][w], 2) for w in names}
    print(f"{'policy':10} " + " ".join(f"{w:>9}" for w in names) + "   (tok/s, medians)")
    for policy, med in medians.items():
        print(f"{policy:10} " + " ".join(f"{med[w]:9.1f}" for w in names))
    print("PASSIVE/ACTIVE " + " ".join(f"{w}={r:.2f}" for w, r in ratios.items()))
    doc = {"model": args.model, "dtype": args.dtype, "max_tokens": args.max_tokens,
           "rounds": args.rounds, "load_average": os.getloadavg(),
           "tokens_per_s": {p: [[r[w]["tokens_per_s"] for w in names] for r in results]
                            for p, results in runs.items()},
           "medians": medians, "ratios": ratios}  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
