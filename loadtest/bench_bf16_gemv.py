"""Our bf16 GEMV (engine/kernels/cpu/bf16_gemm.py) against oneDNN and a plain memory read.

    python -m loadtest.bench_bf16_gemv [--rounds 5] [--rows 1,4,16] [--shapes smol,1b]
        [--baseline OTHER_CHECKOUT] [--json loadtest/results/bf16-gemv.json]

Shapes (in -> out): SmolLM2-135M's qkv-like 576->1728, gate_up 576->3072, down 1536->576,
lm_head 576->49152; a 1B Llama's (Llama-3.2-1B) qkv 2048->3072, gate_up 2048->16384, down
8192->2048, lm_head 2048->49152. Columns, per row count (bf16 activations, torch's threads):
- gemv: our kernel called directly, on the weight packed in pairs along K;
- packed: oneDNN's `_linear_pointwise` on its own packed layout (the engine's previous default;
  left out, as NaN, on a CPU where oneDNN has no bf16 packing: no AVX-512 BW/VL/DQ nor
  AVX-NE-CONVERT, e.g. AMD Zen 3);
- plain: `F.linear` on the checkpoint layout (oneDNN repacks it inside every call);
- read: `torch.sum` over the same weight bytes, the memory-read yardstick;
- gemv_hp (with `--huge-pages`): our kernel on a copy of the packed weight in transparent huge
  pages (madvise; the engine packs that way by default: engine/huge_pages.py);
- gemv_base (with `--baseline DIR`): the kernel as another checkout has it (its
  engine/kernels/cpu/bf16_gemm.cpp, built beside this one and called in the same process), so a
  change to the kernel is measured against the code before it, the two alternating call by
  call; the table adds base/gemv (> 1: this tree's is faster).
Each round times every column in turn (alternating; each sample is the mean of enough calls to
last ~20 ms); the table gives medians over the rounds, GB/s of weight bytes (out * in * 2) per
median call, and the ratios packed/gemv and plain/gemv (> 1: ours is faster). The same weight
is read call after call, so SmolLM2's small layers sit in the 32 MB L3 (GB/s above DRAM's);
the 1B shapes do not. Figures in loadtest/JOURNAL.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from functools import partial
from pathlib import Path

SHAPES = {
    "smol": {"qkv": (576, 1728), "gate_up": (576, 3072), "down": (1536, 576),
             "lm_head": (576, 49152)},
    "1b": {"qkv": (2048, 3072), "gate_up": (2048, 16384), "down": (8192, 2048),
           "lm_head": (2048, 49152)},
}  # fmt: skip
COLUMNS = ("gemv", "packed", "plain", "read")


def _sample(fn, target_s: float = 0.02) -> float:
    """Seconds per call, the mean of enough calls to last about `target_s`."""
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    repeat = max(1, int(target_s / once))
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def main(argv: list[str] | None = None) -> int:
    # engine first: it sets the OpenMP wait policy, which must precede torch's libgomp start.
    from engine.kernels.cpu import bf16_gemm
    from engine.platform import cpu_info

    # isort: split
    import torch
    import torch.nn.functional as F

    parser = argparse.ArgumentParser(prog="bench_bf16_gemv")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rows", default="1,4,16")
    parser.add_argument("--shapes", default="smol,1b")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--huge-pages", action="store_true", help="add the gemv_hp column")
    parser.add_argument(
        "--baseline", type=Path, default=None,
        help="another checkout: add its kernel (gemv_base) and base/gemv",
    )  # fmt: skip
    args = parser.parse_args(argv)
    columns = (COLUMNS + (("gemv_hp",) if args.huge_pages else ())
               + (("gemv_base",) if args.baseline else ()))  # fmt: skip
    extension = bf16_gemm.load()
    if extension is None:
        raise SystemExit("the C++ kernel did not build here (no compiler)")
    base = _baseline_kernel(args.baseline) if args.baseline is not None else None
    isa = bf16_gemm.best_isa()
    load_before = os.getloadavg()
    print(f"cpu {cpu_info().model_name}, {torch.get_num_threads()} threads, isa {isa}, "
          f"load average {load_before[0]:.1f}")  # fmt: skip
    print(f"{'shape':12} {'rows':>4} " + " ".join(f"{c + ' us':>9}" for c in columns)
          + " " + " ".join(f"{c + ' GB/s':>11}" for c in columns)
          + f" {'packed/gemv':>11} {'plain/gemv':>10}"
          + (f" {'base/gemv':>9}" if base is not None else ""))  # fmt: skip
    results = []
    torch.manual_seed(0)
    for group in args.shapes.split(","):
        for name, (in_features, out_features) in SHAPES[group].items():
            weight = (torch.randn(out_features, in_features) * 0.02).to(torch.bfloat16)
            packed = bf16_gemm.pack(weight, huge_pages=False)
            packed_hp = bf16_gemm.pack(weight, huge_pages=True) if args.huge_pages else None
            try:
                onednn = torch.ops.mkldnn._reorder_linear_weight(weight, 32)
            except RuntimeError:  # no bf16 packing on this CPU
                onednn = None
            nbytes = weight.numel() * weight.element_size()
            for rows in [int(r) for r in args.rows.split(",")]:
                x = torch.randn(rows, in_features).to(torch.bfloat16)
                fns = {
                    "gemv": partial(bf16_gemm.gemm, extension, x, packed, None, out_features),
                    "packed": partial(
                        torch.ops.mkldnn._linear_pointwise, x, onednn, None, "none", [], ""
                    )
                    if onednn is not None
                    else None,
                    "plain": partial(F.linear, x, weight),
                    "read": weight.sum,
                }
                if packed_hp is not None:
                    fns["gemv_hp"] = partial(bf16_gemm.gemm, extension, x, packed_hp, None,
                                             out_features)  # fmt: skip
                if base is not None:
                    fns["gemv_base"] = partial(bf16_gemm.gemm, base, x, packed, None, out_features)
                times: dict[str, list[float]] = {c: [] for c in columns}
                with torch.inference_mode():
                    for _ in range(args.rounds):
                        for column, fn in fns.items():
                            times[column].append(float("nan") if fn is None else _sample(fn))
                median = {c: statistics.median(v) for c, v in times.items()}
                gb_s = {c: nbytes / median[c] / 1e9 for c in columns}
                row = {"group": group, "shape": name, "in": in_features, "out": out_features,
                       "rows": rows, "median_us": {c: median[c] * 1e6 for c in columns},
                       "samples_us": {c: [t * 1e6 for t in v] for c, v in times.items()},
                       "gb_s": gb_s, "packed_over_gemv": median["packed"] / median["gemv"],
                       "plain_over_gemv": median["plain"] / median["gemv"]}  # fmt: skip
                if base is not None:
                    row["base_over_gemv"] = median["gemv_base"] / median["gemv"]
                results.append(row)
                label = f"{group}:{name}"
                print(f"{label:12} {rows:>4} "
                      + " ".join(f"{median[c] * 1e6:9.1f}" for c in columns) + " "
                      + " ".join(f"{gb_s[c]:11.1f}" for c in columns)
                      + f" {row['packed_over_gemv']:11.2f} {row['plain_over_gemv']:10.2f}"
                      + (f" {row['base_over_gemv']:9.2f}" if base is not None else ""),
                      flush=True)  # fmt: skip
    load_after = os.getloadavg()
    print(f"load average after: {load_after[0]:.1f}")
    print(json.dumps({"summary": [
        {k: r[k] for k in ("group", "shape", "rows", "packed_over_gemv", "plain_over_gemv",
                           "base_over_gemv") if k in r}
        | {"gemv_gb_s": round(r["gb_s"]["gemv"], 1), "read_gb_s": round(r["gb_s"]["read"], 1)}
        for r in results]}))  # fmt: skip
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"cpu": cpu_info().model_name, "threads": torch.get_num_threads(), "isa": isa,
                "rounds": args.rounds, "torch": torch.__version__, "huge_pages": args.huge_pages,
                "baseline": None if args.baseline is None else str(args.baseline),
                "load_average": {"before": load_before, "after": load_after}}  # fmt: skip
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return 0


def _baseline_kernel(checkout: Path):
    """The bf16 GEMV extension built from another checkout's source (its own cache entry: the
    name carries the source's digest), to call beside this tree's."""
    from engine.kernels.cpu import bf16_gemm

    source = checkout / "engine" / "kernels" / "cpu" / "bf16_gemm.cpp"
    if not source.is_file():
        raise SystemExit(f"{checkout} has no {source.relative_to(checkout)}")
    module = bf16_gemm.build(source=source)
    if module is None:
        raise SystemExit(f"the baseline's kernel did not build ({source})")
    return module


if __name__ == "__main__":
    raise SystemExit(main())
