"""Quantized GEMM kernels against each other and against bf16 (oneDNN-packed), per shape.

    python -m loadtest.bench_quant_kernels [--rounds 3] [--rows 1,8,32,64]

SmolLM2-135M shapes: qkv 576->960, o 576->576, gate_up 576->3072, down 1536->576, lm_head
576->49152. The kernels run in alternating rounds; each cell is (bf16 median time) / (kernel
median time), so > 1 means faster than bf16. w8a8 is the layer as the engine runs it (int8 weight-only
kernel below 16 rows, torch._int_mm from 16). The table in engine/quant/linear.py comes from here.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial

import torch

SHAPES = {
    "qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576),
    "lm_head": (576, 49152),
}  # fmt: skip
SCHEMES = ("int8", "int4", "w8a8")


def _time(fn, repeat: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def main(argv: list[str] | None = None) -> int:
    from engine.layers.linear import Linear
    from engine.quant.config import QuantConfig
    from engine.quant.linear import QuantLinear

    parser = argparse.ArgumentParser(prog="bench_quant_kernels")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", default="1,8,32,64")
    args = parser.parse_args(argv)
    rows_list = [int(r) for r in args.rows.split(",")]
    print(f"{'shape':8} {'rows':>4} {'bf16 ms':>8} " + " ".join(f"{s:>6}" for s in SCHEMES))
    for name, (in_features, out_features) in SHAPES.items():
        weight = torch.randn(out_features, in_features) * 0.02
        dense = Linear(in_features, out_features, False, torch.bfloat16)
        dense.weight_loader(dense.weight, weight, None)
        dense.pack()
        layers = {}
        for scheme in SCHEMES:
            layer = QuantLinear(in_features, out_features, False, torch.bfloat16,
                                QuantConfig(scheme))  # fmt: skip
            layer.weight_loader(layer.weight, weight, None)
            layer.pack()
            layers[scheme] = layer
        for rows in rows_list:
            x = torch.randn(rows, in_features).to(torch.bfloat16)
            fns = {"bf16": partial(dense, x)}
            fns.update({scheme: partial(layer, x) for scheme, layer in layers.items()})
            repeat = max(3, int(2e7 / (in_features * out_features * max(rows, 8))))
            times: dict[str, list[float]] = {k: [] for k in fns}
            for _ in range(args.rounds):
                for key, fn in fns.items():
                    times[key].append(_time(fn, repeat))
            base = statistics.median(times["bf16"])
            ratios = " ".join(f"{base / statistics.median(times[s]):6.2f}" for s in SCHEMES)
            print(f"{name:8} {rows:>4} {base * 1e3:8.3f} {ratios}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
