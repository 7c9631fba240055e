"""loadtest/gpu_check.py's stand-ins for libraries the GPU machine lacks. (The script itself
runs on CPU with `--dry-run`; that takes a minute in the interpreter, so it is not a test.)"""

from __future__ import annotations

import importlib.util
import json
import sys

from loadtest.gpu_check import install_missing_module_shims

SHIMMED = ("structlog", "platformdirs")


def test_shims_only_what_is_missing(monkeypatch, capsys):
    assert install_missing_module_shims() == []  # all installed here: nothing replaced
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name in SHIMMED else real_find_spec(name, *a),
    )
    saved = {name: sys.modules.get(name) for name in SHIMMED}
    try:
        assert install_missing_module_shims() == list(SHIMMED)
        sys.modules["structlog"].get_logger(__name__).info("cuda_graphs.captured", capture_s=1.5)
        record = json.loads(capsys.readouterr().err)
        assert record == {"level": "info", "event": "cuda_graphs.captured", "capture_s": 1.5}
        cache = sys.modules["platformdirs"].user_cache_dir("mini-infer")
        assert cache.endswith("/.cache/mini-infer")
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
