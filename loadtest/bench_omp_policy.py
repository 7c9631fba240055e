"""The OpenMP wait policy's cost: engine tok/s under each libgomp waiting policy.

Policies (each an environment for a fresh engine process, since libgomp reads it once, when
torch loads it): libgomp's default (spin up to 300k iterations, then sleep), PASSIVE (sleep at
once), ACTIVE (spin forever), GOMP_SPINCOUNT=10k / 100k (spin a while, then sleep), and the
chosen spin count with threads bound to cores (OMP_PROC_BIND). With `--busy` every run is
repeated beside a competing thread in the engine's process: a Python loop that works 1 ms and
sleeps 1 ms, as the worker's event loop does beside the engine thread. The policies alternate
for `--rounds` rounds; medians and ratios against PASSIVE are printed. Not a test: the numbers
go in loadtest/JOURNAL.md and the choice in engine/openmp.py.

    python -m loadtest.bench_omp_policy --quantization int4 --workloads W1,W2 --rounds 3 --busy
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

from engine.openmp import OPT_OUT_VAR, POLICY_VARS, SET_BY_ENGINE_VAR
from loadtest.bench_engine import measure
from loadtest.report import emit

POLICIES: dict[str, dict[str, str]] = {
    "default": {OPT_OUT_VAR: "off"},
    "PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
    "ACTIVE": {"OMP_WAIT_POLICY": "ACTIVE"},
    "spin10k": {"GOMP_SPINCOUNT": "10000"},
    "spin100k": {"GOMP_SPINCOUNT": "100000"},
    "spin100k+bind": {"GOMP_SPINCOUNT": "100000", "OMP_PROC_BIND": "close", "OMP_PLACES": "cores"},
}
_TOUCHED = (*POLICY_VARS, OPT_OUT_VAR, SET_BY_ENGINE_VAR, "OMP_PROC_BIND", "OMP_PLACES")


def _run(policy: str, spec: dict) -> dict:
    """One engine child under `policy`: the parent's environment, less every OpenMP setting,
    plus the policy's (the spawned child inherits os.environ)."""
    saved = {name: os.environ.pop(name, None) for name in _TOUCHED}
    os.environ.update(POLICIES[policy])
    try:
        return measure("engine", spec)["results"]
    finally:
        for name in _TOUCHED:
            os.environ.pop(name, None)
            if saved[name] is not None:
                os.environ[name] = saved[name]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default=None, help="int4 | int8 | w8a8 | none")
    parser.add_argument("--workloads", default="W1,W2")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--busy", action="store_true", help="also beside a competing thread")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)

    from engine.loader import resolve_model

    names, policies = args.workloads.split(","), args.policies.split(",")
    quantization = None if args.quantization in (None, "none") else args.quantization
    spec = {"model": args.model, "model_path": str(resolve_model(args.model)),
            "dtype": args.dtype, "max_tokens": args.max_tokens, "workloads": names,
            "compile": "auto", "quantization": quantization}  # fmt: skip
    settings = [(p, busy) for busy in ([False, True] if args.busy else [False]) for p in policies]
    runs: dict[str, list[dict]] = {}
    for round_index in range(args.rounds):
        for policy, busy in settings:
            key = policy + (" +busy" if busy else "")
            print(f"[omp] round {round_index + 1}: {key} ...", file=sys.stderr, flush=True)
            result = _run(policy, {**spec, "busy_thread": busy})
            runs.setdefault(key, []).append(result)
            print(f"[omp] {key}: " + " ".join(f"{w}={result[w]['tokens_per_s']}" for w in names)
                  + f" (load average {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)  # fmt: skip
    medians = {
        key: {w: statistics.median(r[w]["tokens_per_s"] for r in results) for w in names}
        for key, results in runs.items()
    }
    print(f"{'policy':20} " + " ".join(f"{w:>9}" for w in names) + "   (tok/s, medians)"
          + "   / PASSIVE")  # fmt: skip
    for key, med in medians.items():
        base = medians.get("PASSIVE" + key[len(key.split(" ")[0]) :])
        ratios = " ".join(f"{med[w] / base[w]:5.2f}" for w in names) if base else ""
        print(f"{key:20} " + " ".join(f"{med[w]:9.1f}" for w in names) + f"   {ratios}")
    doc = {"model": args.model, "dtype": args.dtype, "quantization": quantization,
           "max_tokens": args.max_tokens, "rounds": args.rounds,
           "load_average": os.getloadavg(), "policies": {p: POLICIES[p] for p in policies},
           "tokens_per_s": {k: [[r[w]["tokens_per_s"] for w in names] for r in results]
                            for k, results in runs.items()},
           "medians": medians}  # fmt: skip
    emit(doc, args.out, None, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
