"""One logging configurator for the service: structlog key-value events, JSON when the output is
not a terminal (log shippers parse it), a console renderer in a TTY (people read it).

Stdlib loggers (aiokafka, transformers) go through the same processors, so a broker warning and a
worker event land in one stream in one format. Per-message context (key, request_id, partition,
offset) is bound with `structlog.contextvars` by the consumer while it handles a message, so it
reaches every event logged during that handling. Events logged later for a request (when the
engine's output comes back) name their request_id and attempt explicitly.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog

# Chatty at INFO, and their INFO lines (group joins, fetch sessions) say nothing an operator needs.
_QUIET_LOGGERS = {"aiokafka": logging.WARNING, "kafka": logging.WARNING, "httpx": logging.WARNING}


def configure_logging(
    level: str = "info", log_format: str = "auto", stream: TextIO | None = None
) -> None:
    """Configure structlog and the stdlib root logger. Idempotent: the last call wins."""
    stream = stream or sys.stderr
    is_json = log_format == "json" or (log_format == "auto" and not stream.isatty())
    shared: list = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    renderer = (
        structlog.processors.JSONRenderer()
        if is_json
        else structlog.dev.ConsoleRenderer(
            colors=stream.isatty(), exception_formatter=structlog.dev.plain_traceback
        )  # plain tracebacks, as in the JSON logs (rich is not imported: engine/lean_imports.py)
    )
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info if is_json else _keep,
            renderer,
        ],
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name, quiet_level in _QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(max(quiet_level, root.level))


def _keep(logger, method_name, event_dict):
    """The console renderer formats exceptions itself (with a readable traceback)."""
    return event_dict
