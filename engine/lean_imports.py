"""structlog without rich: 4.4 MiB of every engine process that nothing in it uses.

structlog imports rich (and, through it, pygments, decimal, html and more) whenever rich is
installed, to draw tracebacks in its console renderer and the locals of `dict_tracebacks`.
transformers' dependencies install rich, so it always is here. Measured after `import torch`:
`import structlog` adds 5.2 MiB of resident memory, 0.8 MiB with rich hidden from it. The
service's logs do not need rich: its JSON logs format tracebacks as plain text, and its console
renderer is given plain tracebacks too (worker/service/log_config.py). At W2 with int4 weights
and the int8 KV cache those 4.4 MiB are 1% of the engine's peak RSS, whose target is 1.2x
llama-server's (loadtest/JOURNAL.md, sixteenth session).

So importing this module (`engine` does it first, and so does `mini-infer serve`, the worker)
imports structlog with rich hidden from it: an entry of None in `sys.modules` makes `import
rich` fail, and it is removed again at once. Only structlog's choice is made without rich:
rich itself stays importable, and a program that imports structlog (or rich) before the engine
keeps structlog's rich tracebacks. (While structlog is being imported, another thread's `import
rich` would fail too; the engine is imported at start-up, before a program has such threads.)
"""

from __future__ import annotations

import sys


def import_structlog_without_rich() -> None:
    """Import structlog with rich hidden from it, unless either is imported already."""
    if "structlog" in sys.modules or "rich" in sys.modules:
        return
    sys.modules["rich"] = None  # type: ignore[assignment]  # `import rich` now fails
    try:
        import structlog  # noqa: F401  (structlog.dev and structlog.tracebacks with it)
    finally:
        if "rich" in sys.modules and sys.modules["rich"] is None:
            del sys.modules["rich"]


import_structlog_without_rich()
