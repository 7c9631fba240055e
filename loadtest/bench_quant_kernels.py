"""Quantized GEMM kernels against each other and against bf16 (oneDNN-packed), per shape.

    python -m loadtest.bench_quant_kernels [--rounds 5] [--rows 1,8,32,64] [--json out.json]
    python -m loadtest.bench_quant_kernels --isas avx2,avx2_int8,avx512vnni [--rows 1,4,32]
    python -m loadtest.bench_quant_kernels --engine [--quantizations none,int4,int4@torch]
        [--llamacpp] [--workloads W1] [--rounds 3] [--json out.json]

SmolLM2-135M shapes: qkv 576->960, o 576->576, gate_up 576->3072, down 1536->576, lm_head
576->49152; with `--shapes 1b_qkv,1b_o,1b_gate_up,1b_down,1b_lm_head` the 1B benchmark
model's (2048->3072, 2048->2048, 2048->16384, 8192->2048, 2048->49152). Columns, for bf16 activations:
- int8 / int4: torch's weight-only kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`);
- int8c / int4c: the C++ kernel of engine/kernels/cpu/quant_gemm.py called directly (the
  layer runs it at every row count where it builds);
- w8a8: the layer as the engine runs it with torch's kernels (int8 weight-only below 16 rows,
  torch._int_mm from 16).
The kernels run in alternating rounds; each cell is (bf16 median time) / (kernel median time),
so > 1 means faster than bf16; `c/t` is torch's time over the C++ kernel's for the same scheme;
GB/s is the C++ kernel's packed weight bytes (codes and scales) over its median time. The tables
in engine/quant/linear.py and engine/kernels/cpu/quant_gemm.py come from here.

`--isas avx2,avx2_int8,avx512vnni` compares the C++ kernel's paths instead (each forced; the
paths this CPU cannot run are left out): int4 g32 for every shape but lm_head, which the engine
keeps in int8, with the weights streamed from memory (a pool of copies larger than the caches,
a different copy each call, as a decode step reads them): microseconds and GB/s of packed
weight bytes per path, the fastest of the rounds, and each path's speed over the first's.

`--engine` runs whole workloads instead (loadtest/bench_engine.py's processes, bf16), one engine
per quantization spec ("int4@torch": torch's kernels only, the A/B of the C++ kernel), plus
llama.cpp on its Q4_1 GGUF with `--llamacpp`, all alternating round by round; it prints the
medians and each one's ratio to the first spec and to llama.cpp.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

SHAPES = {
    "qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576),
    "lm_head": (576, 49152),
}  # fmt: skip
# The 1B benchmark model's (loadtest/make_bench_model.py), for `--shapes` (not run by default).
SHAPES_1B = {
    "1b_qkv": (2048, 3072), "1b_o": (2048, 2048), "1b_gate_up": (2048, 16384),
    "1b_down": (8192, 2048), "1b_lm_head": (2048, 49152),
}  # fmt: skip
ALL_SHAPES = {**SHAPES, **SHAPES_1B}
COLUMNS = ("int8", "int8c", "int4", "int4c", "w8a8")


def _time(fn, repeat: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def main(argv: list[str] | None = None) -> int:
    # engine first: it sets the OpenMP wait policy, which must precede torch's libgomp start.
    from engine.kernels.cpu import quant_gemm
    from engine.layers.linear import Linear
    from engine.platform import cpu_info
    from engine.quant.config import QuantConfig
    from engine.quant.linear import QuantLinear

    # isort: split
    import torch

    parser = argparse.ArgumentParser(prog="bench_quant_kernels")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rows", default="1,8,32,64")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--engine", action="store_true", help="whole-engine workloads instead")
    parser.add_argument("--quantizations", default="none,int4,int4@torch,int8,int8@torch")
    parser.add_argument("--workloads", default="W1")
    parser.add_argument("--llamacpp", action="store_true", help="also llama.cpp on the GGUF")
    parser.add_argument("--isas", default=None, help="compare the C++ kernel's paths instead")
    args = parser.parse_args(argv)
    if args.engine:
        return run_engines(args)
    if args.isas:
        return run_isas(args)
    rows_list = [int(r) for r in args.rows.split(",")]
    extension = quant_gemm.load()
    if extension is None:
        print("the C++ kernel did not build here: no int8c/int4c columns", file=sys.stderr)
    header = " ".join(f"{c:>6}" for c in COLUMNS)
    print(f"{'shape':8} {'rows':>4} {'bf16 ms':>8} {header}  {'c/t 8':>6} {'c/t 4':>6} "
          f"{'GB/s 8c':>7} {'GB/s 4c':>7}")  # fmt: skip
    results = []
    for name in args.shapes.split(","):
        in_features, out_features = ALL_SHAPES[name]
        weight = torch.randn(out_features, in_features) * 0.02
        dense = Linear(in_features, out_features, False, torch.bfloat16)
        dense.weight_loader(dense.weight, weight, None)
        dense.pack()
        layers = {}
        for scheme in ("int8", "int4", "w8a8"):
            layer = QuantLinear(in_features, out_features, False, torch.bfloat16,
                                QuantConfig(scheme, kernel="torch"))  # fmt: skip
            layer.weight_loader(layer.weight, weight, None)
            cpp = layer.quantized_state()
            if scheme == "int4":
                int4_packed = quant_gemm.pack_int4(cpp["weight"], cpp["scale"], cpp["minimum"])
            elif scheme == "int8":
                int8_packed = quant_gemm.pack_int8(cpp["weight"], cpp["scale"])
            layer.pack()
            layers[scheme] = layer
        packed_bytes = {
            key: sum(t.numel() * t.element_size() for t in packed)
            for key, packed in (("int8c", int8_packed), ("int4c", int4_packed))
        }
        for rows in rows_list:
            x = torch.randn(rows, in_features).to(torch.bfloat16)
            fns = {"bf16": partial(dense, x)}
            fns.update({scheme: partial(layer, x) for scheme, layer in layers.items()})
            if extension is not None:
                fns["int8c"] = partial(
                    quant_gemm.int8_gemm, extension, x, *int8_packed, out_features
                )
                fns["int4c"] = partial(
                    quant_gemm.int4_gemm, extension, x, *int4_packed, 32, out_features
                )
            repeat = max(3, int(2e7 / (in_features * out_features * max(rows, 8))))
            times: dict[str, list[float]] = {k: [] for k in fns}
            for _ in range(args.rounds):
                for key, fn in fns.items():
                    times[key].append(_time(fn, repeat))
            median = {key: statistics.median(values) for key, values in times.items()}
            base = median["bf16"]
            row = {"shape": name, "in": in_features, "out": out_features, "rows": rows,
                   "median_s": median}  # fmt: skip
            row["vs_bf16"] = {c: base / median[c] for c in COLUMNS if c in median}
            cells = " ".join(
                f"{row['vs_bf16'][c]:6.2f}" if c in median else f"{'-':>6}" for c in COLUMNS
            )
            extra = ""
            if extension is not None:
                row["cpp_vs_torch"] = {
                    "int8": median["int8"] / median["int8c"],
                    "int4": median["int4"] / median["int4c"],
                }
                row["cpp_gb_s"] = {k: packed_bytes[k] / median[k] / 1e9 for k in packed_bytes}
                extra = (
                    f"  {row['cpp_vs_torch']['int8']:6.2f} {row['cpp_vs_torch']['int4']:6.2f} "
                    f"{row['cpp_gb_s']['int8c']:7.1f} {row['cpp_gb_s']['int4c']:7.1f}"
                )
            print(f"{name:8} {rows:>4} {base * 1e3:8.3f} {cells}{extra}", flush=True)
            results.append(row)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"cpu": cpu_info().model_name, "threads": torch.get_num_threads(),
                "rounds": args.rounds, "torch": torch.__version__}  # fmt: skip
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return 0


POOL_BYTES = 512 << 20  # more than any cache here, so every call reads its weights from memory


def run_isas(args) -> int:
    """The C++ kernel's paths against each other, weights streamed from memory."""
    from engine.kernels.cpu import quant_gemm
    from engine.platform import cpu_info
    from engine.quant.primitives import quantize_int4_groupwise, quantize_int8_per_channel

    # isort: split
    import torch

    extension = quant_gemm.load()
    if extension is None:
        print("the C++ kernel did not build here", file=sys.stderr)
        return 1
    isas = [isa for isa in args.isas.split(",") if quant_gemm.can_run(isa)]
    print(f"{'shape':8} {'rows':>4}  " + "  ".join(f"{isa + ' us':>14} {'GB/s':>5}" for isa in isas)
          + "  " + " ".join(f"{isa + '/' + isas[0]:>20}" for isa in isas[1:]))  # fmt: skip
    results = []
    for name in args.shapes.split(","):
        in_features, out_features = ALL_SHAPES[name]
        weight = torch.randn(out_features, in_features) * 0.02
        if name.endswith("lm_head"):
            packed = quant_gemm.pack_int8(*quantize_int8_per_channel(weight))
            call = partial(quant_gemm.int8_gemm, extension, out_features=out_features)
        else:
            packed = quant_gemm.pack_int4(*quantize_int4_groupwise(weight, 32))
            call = partial(quant_gemm.int4_gemm, extension, group_size=32,
                           out_features=out_features)  # fmt: skip
        nbytes = sum(t.numel() * t.element_size() for t in packed)
        pool = [packed] + [tuple(t.clone() for t in packed) for _ in range(POOL_BYTES // nbytes)]
        for rows in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(rows, in_features).to(torch.bfloat16)
            best = dict.fromkeys(isas, float("inf"))
            calls = 0
            for _ in range(args.rounds):
                for isa in isas:
                    for _ in range(min(len(pool), 64)):
                        weights = pool[calls % len(pool)]
                        calls += 1
                        start = time.perf_counter()
                        call(x, weights[0], weights[1], isa=isa)
                        best[isa] = min(best[isa], time.perf_counter() - start)
            row = {"shape": name, "rows": rows, "bytes": nbytes,
                   "us": {isa: best[isa] * 1e6 for isa in isas},
                   "gb_s": {isa: nbytes / best[isa] / 1e9 for isa in isas}}  # fmt: skip
            results.append(row)
            cells = "  ".join(f"{row['us'][isa]:14.1f} {row['gb_s'][isa]:5.1f}" for isa in isas)
            ratios = " ".join(f"{best[isas[0]] / best[isa]:20.2f}" for isa in isas[1:])
            print(f"{name:8} {rows:>4}  {cells}  {ratios}", flush=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"cpu": cpu_info().model_name, "threads": torch.get_num_threads(),
                "rounds": args.rounds, "isas": isas, "torch": torch.__version__}  # fmt: skip
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return 0


def run_engines(args) -> int:
    from engine.loader import resolve_model
    from loadtest.bench_engine import _default_gguf, measure
    from loadtest.llamacpp_peer import find_server, missing_message

    model_path = str(resolve_model("smollm2-135m"))
    names = args.workloads.split(",")
    specs = {}
    for quant in args.quantizations.split(","):
        specs[f"bf16-{quant}"] = ("engine", None if quant == "none" else quant)
    server, gguf = find_server(None), _default_gguf()
    if args.llamacpp:
        if server is None or gguf is None:
            print(missing_message() if server is None else "no GGUF", file=sys.stderr)
        else:
            specs["llamacpp-gguf"] = ("llamacpp", None)
    runs: dict[str, list[dict]] = {key: [] for key in specs}
    for round_index in range(args.rounds):
        for key, (impl, quant) in specs.items():
            print(f"[bench] round {round_index + 1}: {key} ...", file=sys.stderr, flush=True)
            spec = {"model": "smollm2-135m", "model_path": model_path, "dtype": "bfloat16",
                    "max_tokens": 128, "workloads": names, "compile": "off",
                    "quantization": quant, "llama_server": str(server), "gguf": str(gguf)}  # fmt: skip
            runs[key].append(measure(impl, spec))
    medians = {
        key: {w: statistics.median(r["results"][w]["tokens_per_s"] for r in rs) for w in names}
        for key, rs in runs.items()
    }
    first = next(iter(specs))
    print(f"{'run':22} " + " ".join(f"{w:>8}" for w in names) + "  (tok/s medians; ratios)")
    for key, med in medians.items():
        ratios = " ".join(
            f"/{ref}={med[w] / medians[ref][w]:.2f}"
            for ref in (first, "llamacpp-gguf") if ref in medians and ref != key
            for w in names
        )  # fmt: skip
        print(f"{key:22} " + " ".join(f"{med[w]:8.1f}" for w in names) + f"  {ratios}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rounds": args.rounds, "runs": runs,
                                         "medians": medians}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
