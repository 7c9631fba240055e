"""`mini-infer bench engine|e2e|accuracy|quant-kernels|extend-attention|omp-policy|kv-memory|structured`:
benchmarks print a table and JSON; they are not tests."""

from __future__ import annotations

import argparse
import importlib

BENCHES = {
    "engine": "loadtest.bench_engine",
    "e2e": "loadtest.bench_e2e",
    "accuracy": "loadtest.bench_accuracy",
    "quant-kernels": "loadtest.bench_quant_kernels",
    "extend-attention": "loadtest.bench_extend_attention",
    "omp-policy": "loadtest.bench_omp_policy",
    "kv-memory": "loadtest.kv_memory",
    "structured": "loadtest.bench_structured",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("which", choices=sorted(BENCHES), help="which benchmark")
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="options of that benchmark")


def main(args) -> int:
    return importlib.import_module(BENCHES[args.which]).main(args.rest) or 0
