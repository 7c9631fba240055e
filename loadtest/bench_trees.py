"""One engine setting, this code tree against another checkout: W1 (1 x 128) and W2 (32 x 128)
output tokens/s on the default model, each (tree, round) in a fresh process with that tree first
on PYTHONPATH, trees alternating round by round; medians and this tree's ratio.

    python -m loadtest.bench_trees --baseline /path/to/other/checkout [--rounds 4]
        [--options '{"quantization": "int4", "kv_cache_dtype": "int8"}'] [--workloads W1,W2]
        [--out r.json]

What a change to one setting's speed is worth, measured against the tree before it: the
machine's memory bandwidth moves by up to 1.7x between minutes here, so only sides alternated
in one run compare.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from loadtest.report import emit

HERE = Path(__file__).resolve().parents[1]
WORKLOADS = {"W1": 1, "W2": 32}
CHILD = """
import json, sys
from engine.loader import load_tokenizer, resolve_model
from loadtest.bench_engine import run_engine
from loadtest.workloads import chat_prompts
prompts = chat_prompts(load_tokenizer(resolve_model("smollm2-135m")), 32)
options, workloads = json.loads(sys.argv[1]), json.loads(sys.argv[2])
print(json.dumps({name: run_engine("smollm2-135m", "bfloat16", prompts[:n], 128, **options)
                  ["tokens_per_s"] for name, n in workloads.items()}))
"""


def run_side(tree: Path, options: dict, workloads: dict[str, int]) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(options), json.dumps(workloads)],
        cwd=tree, env=env, check=True, capture_output=True, text=True,
    )  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, required=True, help="the other checkout")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--options", default='{"quantization": "int4"}', help="engine options")
    parser.add_argument("--workloads", default="W1,W2")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    options = json.loads(args.options)
    workloads = {name: WORKLOADS[name] for name in args.workloads.split(",")}
    trees = {"baseline": args.baseline.resolve(), "this": HERE}
    runs: dict[str, list[dict]] = {side: [] for side in trees}
    for round_index in range(args.rounds):
        for side, tree in trees.items():
            runs[side].append(run_side(tree, options, workloads))
            print(f"[bench] round {round_index + 1}/{args.rounds} {side}: {runs[side][-1]}",
                  file=sys.stderr, flush=True)  # fmt: skip
    medians = {side: {w: statistics.median(r[w] for r in rs) for w in workloads}
               for side, rs in runs.items()}  # fmt: skip
    ratio = {w: round(medians["this"][w] / medians["baseline"][w], 3) for w in workloads}
    print(f"{'tree':10}" + "".join(f"{w:>10}" for w in workloads) + "  (tok/s, medians)",
          file=sys.stderr)  # fmt: skip
    for side, med in medians.items():
        print(f"{side:10}" + "".join(f"{med[w]:10.1f}" for w in workloads), file=sys.stderr)
    print(f"{'ratio':10}" + "".join(f"{ratio[w]:10.3f}" for w in workloads), file=sys.stderr)
    doc = {"options": options, "trees": {k: str(v) for k, v in trees.items()},
           "rounds": args.rounds, "runs": runs, "medians": medians,
           "this_over_baseline": ratio}  # fmt: skip
    emit(doc, args.out, None, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
