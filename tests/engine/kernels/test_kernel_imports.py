"""Kernels sit below what calls them: no module under engine/kernels imports from engine/layers,
engine/quant or engine/models (the step's attention metadata and the int8 cache type they read
live in engine/kernels/attention_types.py). Read from the source with ast, so a late import
inside a function counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

KERNELS = Path(__file__).resolve().parents[3] / "engine" / "kernels"
FORBIDDEN = ("engine.layers", "engine.quant", "engine.models")


def is_forbidden(name: str) -> bool:
    return any(name == f or name.startswith(f + ".") for f in FORBIDDEN)


def forbidden_imports(source: str) -> list[str]:
    """The forbidden modules `source` imports, one per import statement or name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if is_forbidden(alias.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if is_forbidden(node.module):
                found.append(node.module)
            else:  # `from engine import layers` imports a forbidden package too
                names = (f"{node.module}.{alias.name}" for alias in node.names)
                found += [name for name in names if is_forbidden(name)]
    return found


def kernel_modules() -> list[Path]:
    return sorted(KERNELS.rglob("*.py"))


def test_the_rule_catches_every_form_of_import():
    source = (
        "import engine.layers.attention\n"
        "from engine.quant.kv_int8 import Int8KVCache\n"
        "def late():\n    from engine import models\n"
        "from engine.kernels.attention_types import AttentionMetadata\n"
        "from engine.platform import cpu_info\n"
    )
    assert forbidden_imports(source) == [
        "engine.layers.attention", "engine.quant.kv_int8", "engine.models",
    ]  # fmt: skip


def test_kernel_modules_found():
    names = {path.relative_to(KERNELS).as_posix() for path in kernel_modules()}
    assert {"attention_types.py", "cpu/paged_attention.py", "cpu/decode_step.py",
            "triton/backend.py"} <= names  # fmt: skip


@pytest.mark.parametrize(
    "path", kernel_modules(), ids=lambda path: path.relative_to(KERNELS).as_posix()
)
def test_kernels_do_not_import_their_callers(path):
    assert forbidden_imports(path.read_text()) == []
