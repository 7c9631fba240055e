"""`mini-infer serve`: run one worker until SIGTERM/SIGINT against the configured Kafka (an
embedded broker only with `--embedded-broker`). Every setting is also a flag (see `--help`)."""

from __future__ import annotations

import argparse
import asyncio
import sys

from pydantic import ValidationError

import engine.lean_imports  # noqa: F401  (first: the worker imports structlog without rich)
from worker.service.log_config import configure_logging
from worker.service.settings import add_settings_arguments, settings_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--version", action="version", version=f"mini-infer {package_version()}")
    add_settings_arguments(parser)


def package_version() -> str:
    """The installed distribution's version; the source tree's when run uninstalled."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mini-infer")
    except PackageNotFoundError:
        return "unknown (not installed)"


def main(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
    except ValidationError as error:
        print(f"mini-infer serve: invalid settings:\n{error}", file=sys.stderr)
        return 2
    obs = settings.observability
    configure_logging(obs.log_level, obs.log_format)
    from worker.service.worker import serve  # imports the engine bridge: only when serving

    return asyncio.run(serve(settings))
