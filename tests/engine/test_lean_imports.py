"""`import engine` loads structlog without rich (4.4 MiB of resident memory nothing uses); rich
itself stays importable, and a program that imported structlog first keeps rich tracebacks.
Each case runs in a fresh interpreter: this test process has imported both long ago."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _run(code: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_import_engine_leaves_rich_out_of_structlog_and_importable() -> None:
    pytest.importorskip("rich")  # nothing to leave out where it is not installed
    state = _run(
        "import json, sys\n"
        "import engine, structlog.dev, structlog.tracebacks\n"
        "before = 'rich' in sys.modules\n"
        "import rich.console\n"
        "print(json.dumps({'loaded': before, 'dev': structlog.dev.rich is not None,\n"
        "    'tracebacks': structlog.tracebacks.rich is not None, 'later': rich.__name__}))"
    )
    assert state == {"loaded": False, "dev": False, "tracebacks": False, "later": "rich"}


def test_structlog_imported_first_keeps_rich() -> None:
    pytest.importorskip("rich")
    state = _run(
        "import json, sys, structlog, engine, structlog.dev\n"
        "print(json.dumps({'dev': structlog.dev.rich is not None}))"
    )
    assert state == {"dev": True}


def test_the_worker_command_gets_structlog_without_rich() -> None:
    """`mini-infer serve` (the worker process); the client commands import no engine at all."""
    pytest.importorskip("rich")
    state = _run(
        "import json, sys, worker.cli.serve\n"
        "print(json.dumps({'rich': 'rich' in sys.modules, 'structlog': 'structlog' in sys.modules}))"
    )
    assert state == {"rich": False, "structlog": True}
