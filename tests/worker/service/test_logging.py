"""One JSON stream: structlog events with bound context, and stdlib loggers bridged into it."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
import structlog

from worker.service.log_config import configure_logging


@pytest.fixture
def stream() -> Iterator[io.StringIO]:
    """Where the test's configured logs go; structlog and the root logger restored after."""
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    try:
        yield io.StringIO()
    finally:
        structlog.reset_defaults()
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in saved_handlers:
            root.addHandler(handler)
        root.setLevel(saved_level)


def test_json_events_carry_bound_context_and_stdlib_records_join_them(stream) -> None:
    configure_logging("info", "auto", stream)  # a StringIO is no terminal: JSON
    with structlog.contextvars.bound_contextvars(request_id="r-1", partition=3, offset=42):
        structlog.get_logger("worker.test").info("request.finished", completion_tokens=5)
        logging.getLogger("some.library").warning("careful: %s", "thing")
    structlog.get_logger("worker.test").debug("hidden")  # below the level
    ours, theirs = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert ours["event"] == "request.finished" and ours["level"] == "info"
    assert (ours["request_id"], ours["partition"], ours["offset"]) == ("r-1", 3, 42)
    assert ours["completion_tokens"] == 5 and "timestamp" in ours
    assert theirs["event"] == "careful: thing" and theirs["logger"] == "some.library"
    assert theirs["level"] == "warning" and theirs["request_id"] == "r-1"


def test_console_events_carry_a_plain_traceback(stream) -> None:
    """In a terminal's format the exception is still rendered, as plain Python prints it (the
    engine imports structlog without rich: engine/lean_imports.py)."""
    configure_logging("info", "console", stream)
    try:
        raise ValueError("the cause")
    except ValueError:
        structlog.get_logger("worker.test").exception("request.handling_failed")
    text = stream.getvalue()
    assert "request.handling_failed" in text
    assert "Traceback (most recent call last):" in text and "ValueError: the cause" in text
    assert "\u256d" not in text  # no box drawn around it (rich's traceback)
