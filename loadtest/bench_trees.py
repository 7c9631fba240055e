"""One engine setting, this code tree against another checkout: W1 (1 x 128) and W2 (32 x 128)
output tokens/s on the default model or `--model` (or the prefill workloads P1, P4: prompt
tokens/s), each (tree, round) in a fresh process with that tree first on PYTHONPATH, trees
alternating round by round; medians and this tree's ratio.

    python -m loadtest.bench_trees --baseline /path/to/other/checkout [--rounds 4]
        [--options '{"quantization": "int4", "kv_cache_dtype": "int8"}'] [--workloads W1,W2]
        [--sampling '{"temperature": 0.7, "top_p": 0.9}'] [--model DIR] [--out r.json]

Greedy unless `--sampling` (SamplingParams fields; request i seeded i). Each side runs this
checkout's `loadtest` against its tree's engine (loadtest/trees.py).

What a change to one setting's speed is worth, measured against the tree before it: the
machine's memory bandwidth moves by up to 1.7x between minutes here, so only sides alternated
in one run compare.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from loadtest.report import emit
from loadtest.trees import ROOT, alternate, print_result

WORKLOADS = {"W1": 1, "W2": 32}  # chat requests; P1, P4: loadtest/workloads.py's documents
PREFILL_WORKLOADS = ("P1", "P4")


def _child(args) -> None:
    from engine.loader import load_tokenizer, resolve_model
    from loadtest.bench_engine import prefill_speed, run_engine
    from loadtest.workloads import chat_prompts, workload_prompts, workloads

    model = args.model
    tokenizer = load_tokenizer(resolve_model(model))
    prompts = chat_prompts(tokenizer, 32)
    options, sampling = json.loads(args.options), json.loads(args.sampling)

    def speed(name: str) -> float:
        if name in PREFILL_WORKLOADS:
            workload = workloads()[name]
            documents = workload_prompts(tokenizer, workload)
            run = run_engine(model, "bfloat16", documents, list(workload.max_tokens),
                             sampling=sampling, **options)  # fmt: skip
            return prefill_speed(documents, run)["prompt_tokens_per_s"]
        return run_engine(model, "bfloat16", prompts[:WORKLOADS[name]], 128,
                          sampling=sampling, **options)["tokens_per_s"]  # fmt: skip

    print_result({name: speed(name) for name in args.workloads.split(",")})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, required=True, help="the other checkout")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--options", default='{"quantization": "int4"}', help="engine options")
    parser.add_argument("--workloads", default="W1,W2")
    parser.add_argument("--sampling", default="null", help="SamplingParams fields (JSON)")
    parser.add_argument("--model", default="smollm2-135m", help="model id or directory")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args)
        return 0
    options = json.loads(args.options)
    workloads = args.workloads.split(",")
    unknown = set(workloads) - set(WORKLOADS) - set(PREFILL_WORKLOADS)
    if unknown:
        parser.error(f"unknown workloads {sorted(unknown)}: W1, W2, P1, P4")
    trees = {"baseline": args.baseline.resolve(), "this": ROOT}
    flags = ["--child", "--options", args.options, "--workloads", args.workloads,
             "--sampling", args.sampling, "--model", args.model,
             "--baseline", str(args.baseline)]  # fmt: skip
    runs = alternate(__file__, trees, flags, args.rounds, timeout_s=1800)
    medians = {side: {w: statistics.median(r[w] for r in rs) for w in workloads}
               for side, rs in runs.items()}  # fmt: skip
    ratio = {w: round(medians["this"][w] / medians["baseline"][w], 3) for w in workloads}
    print(f"{'tree':10}" + "".join(f"{w:>10}" for w in workloads) + "  (tok/s, medians)",
          file=sys.stderr)  # fmt: skip
    for side, med in medians.items():
        print(f"{side:10}" + "".join(f"{med[w]:10.1f}" for w in workloads), file=sys.stderr)
    print(f"{'ratio':10}" + "".join(f"{ratio[w]:10.3f}" for w in workloads), file=sys.stderr)
    doc = {"model": args.model, "options": options, "sampling": json.loads(args.sampling), "trees": {k: str(v) for k, v in trees.items()},
           "rounds": args.rounds, "runs": runs, "medians": medians,
           "this_over_baseline": ratio}  # fmt: skip
    emit(doc, args.out, None, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
