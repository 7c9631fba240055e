"""The `mini-infer` command. Each subcommand lives in its own module, imported only when used,
so `mini-infer generate` never pays for importing torch."""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, help). Each module defines `add_arguments(parser)` and `main(args) -> int`.
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": (
        "worker.cli.serve",
        "run a worker against a Kafka cluster (--embedded-broker for development)",
    ),
    "broker": ("worker.cli.broker", "run the embedded Kafka-compatible broker alone"),
    "generate": ("worker.cli.generate", "send one request and stream the reply to stdout"),
    "demo": ("worker.cli.demo", "embedded broker + worker + a client streaming three answers"),
    "fetch-model": (
        "worker.cli.fetch_model",
        "download/convert the default model and print its path",
    ),
    "bench": (
        "worker.cli.bench",
        "benchmarks: engine, e2e, accuracy, quant-kernels (JSON + table)",
    ),
    "loadtest": ("loadtest.loadgen", "load generator through Kafka, reports like vllm bench serve"),
    "soak": (
        "loadtest.soak",
        "minutes of mixed load on one worker: RSS, fds, KV blocks, p99 drift",
    ),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mini-infer", description="Mini-Infer LLM worker")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, add_help=False)
        p.set_defaults(_module=module_name)
        # Only the chosen command's module is imported to register its arguments.
    args_list = sys.argv[1:] if argv is None else argv
    known, _ = parser.parse_known_args(args_list)
    module = importlib.import_module(known._module)
    full = argparse.ArgumentParser(
        prog=f"mini-infer {known.command}", description=COMMANDS[known.command][1]
    )
    module.add_arguments(full)
    args = full.parse_args(args_list[1:])
    try:
        return int(module.main(args) or 0)
    except KeyboardInterrupt:
        return 130
