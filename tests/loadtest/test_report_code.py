"""Every benchmark result names the code it measured (`loadtest.report.code_under_test`): the
checkout its packages were imported from, the commit, and whether tracked files had changed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.report import code_under_test, emit


def git(tree: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(tree), *args], check=True, capture_output=True, text=True
    ).stdout.strip()


@pytest.fixture
def checkout(tmp_path, monkeypatch) -> Path:
    """A git checkout holding a package of its own, first on the import path."""
    tree = tmp_path / "tree"
    package = tree / "provenance_probe"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("VALUE = 1\n")
    git(tree, "init", "-q")
    git(tree, "-c", "user.name=t", "-c", "user.email=t@t", "add", ".")
    git(tree, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "probe")
    monkeypatch.syspath_prepend(str(tree))
    monkeypatch.delitem(sys.modules, "provenance_probe", raising=False)
    return tree


def test_the_checkout_a_package_came_from_its_commit_and_its_changes(checkout) -> None:
    code = code_under_test("provenance_probe")
    assert code == {"tree": str(checkout.resolve()), "commit": git(checkout, "rev-parse", "HEAD"),
                    "dirty": False}  # fmt: skip
    (checkout / "provenance_probe" / "__init__.py").write_text("VALUE = 2\n")
    assert code_under_test("provenance_probe")["dirty"] is True


def test_a_package_outside_git_or_not_found_names_no_commit(tmp_path, monkeypatch) -> None:
    (tmp_path / "loose_probe").mkdir()
    (tmp_path / "loose_probe" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    loose = code_under_test("loose_probe")
    assert loose["tree"] == str(tmp_path.resolve()) and loose["commit"] is None
    assert code_under_test("no_such_package_anywhere") == {
        "tree": None, "commit": None, "dirty": None,
    }  # fmt: skip


def test_emit_puts_the_code_into_the_printed_and_written_document(tmp_path, capsys) -> None:
    out = tmp_path / "r.json"
    emit({"ratio": 1.5}, out, None, None)
    printed, written = json.loads(capsys.readouterr().out), json.loads(out.read_text())
    assert printed == written and printed["ratio"] == 1.5
    assert printed["code"]["tree"] == str(Path(__file__).resolve().parents[2])
