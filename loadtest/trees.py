"""A benchmark script run against another checkout: a fresh process in which that checkout's
`engine/`, `worker/` and `schemas/` come first but this checkout's `loadtest/` runs (an older
checkout may lack the script or the helpers it imports), its result read back from the line it
prints with `print_result`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from loadtest.report import code_under_test

ROOT = Path(__file__).resolve().parent.parent
_RESULT = "RESULT "

# The child's start: this checkout's `loadtest` package imported (and so kept) before the
# tree goes first on the path for everything else; then the script as __main__.
_BOOT = """
import runpy, sys
tree, root, script = sys.argv[1:4]
sys.path.insert(0, root)
import loadtest
sys.path.insert(0, tree)
sys.argv = [script, *sys.argv[4:]]
runpy.run_path(script, run_name="__main__")
"""


def print_result(result) -> None:
    """A child's result, as `run_in_tree` reads it back; a dict also names the checkout whose
    code it ran (`code`: the tree `worker` came from, its commit, uncommitted changes)."""
    if isinstance(result, dict) and "code" not in result:
        result = {**result, "code": code_under_test()}
    print(_RESULT + json.dumps(result), flush=True)


def run_in_tree(
    script: str, tree: Path, flags: list[str], timeout_s: float, env: dict | None = None
):
    """`script` (a file of this checkout's `loadtest/`) with `flags` in a fresh process, in
    `tree`, with `tree`'s packages (also first on the PYTHONPATH its own children inherit;
    `env`: more environment variables): the result it printed."""
    cmd = [sys.executable, "-c", _BOOT, str(tree), str(ROOT), str(Path(script).resolve()), *flags]
    run_env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{ROOT}", **(env or {})}
    out = subprocess.run(
        cmd, cwd=tree, env=run_env, capture_output=True, text=True, timeout=timeout_s
    )
    for line in out.stdout.splitlines():
        if line.startswith(_RESULT):
            return json.loads(line[len(_RESULT) :])
    raise RuntimeError(f"{tree}: no result\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")


def sides_of(baseline: Path | None) -> dict[str, Path]:
    """This checkout as "this", and `baseline` (another checkout) as "baseline" where given."""
    return {"this": ROOT, **({"baseline": baseline.resolve()} if baseline is not None else {})}


def alternate(
    script: str,
    sides: dict[str, Path],
    flags: list[str],
    rounds: int,
    timeout_s: float,
    env: dict | None = None,
    label: str = "",
) -> dict[str, list]:
    """`script` with `flags` in each side's tree in turn (`run_in_tree`), `rounds` times, each
    round's result printed as it comes: each side's results, in round order. The order within
    a round flips every round (ABBA...): with the same side always first, P1 measured the
    second side 0.86-0.90x in two runs of bench_trees where fresh processes in ABBA order gave
    1.0 (loadtest/JOURNAL.md, twenty-ninth session)."""
    runs: dict[str, list] = {name: [] for name in sides}
    for i in range(rounds):
        order = list(sides.items())
        for name, tree in order if i % 2 == 0 else reversed(order):
            runs[name].append(run_in_tree(script, tree, flags, timeout_s, env))
            print(f"[bench] {label}round {i + 1}/{rounds} {name}: {runs[name][-1]}",
                  file=sys.stderr, flush=True)  # fmt: skip
    return runs
