"""OpenMP wait policy: the engine's threads sleep, not spin, while they wait for each other.

Why PASSIVE: where the cores are shared (the worker's event loop, the broker, other jobs), a
libgomp thread that spins at the end of a parallel region (its default: up to 300k iterations,
then sleep) holds the core its partner needs; measured on the shared 2-core Zen 4 VM, PASSIVE
ran one stream 4-40x faster than libgomp's default and spin counts of 10k-100k (every table:
loadtest/JOURNAL.md, "OpenMP wait policy"). On an idle machine the per-operator step pays for it
(2026-12-03, idle VM, W1 int4: 37 tok/s with PASSIVE against 89 with libgomp's default and 91
with GOMP_SPINCOUNT=100000); the fused decode step (engine/fused_decode.py) takes
that cost away where it applies: one parallel region per step, whose barriers spin briefly and
then sleep. A dedicated machine may still set GOMP_SPINCOUNT or OMP_WAIT_POLICY itself (either
one set means nothing is added here) or MINI_INFER_OMP_DEFAULTS=off for libgomp's defaults.

It must be in the environment before libgomp starts, i.e. before torch is first imported:
`import engine` sets it, and the model runner logs a warning when torch was imported first and
the default could not apply. What it set is recorded in the environment (for child processes
too), so a process that is not ours, such as the llama.cpp benchmark peer, starts without it
(`environ_before_import`).
"""

from __future__ import annotations

import os
import sys

DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}
# The names this module put into os.environ, comma-separated: inherited by child processes
# (the bench's spawned children import engine again and must still know which values were ours).
SET_BY_ENGINE_VAR = "MINI_INFER_OMP_SET_BY_ENGINE"
# MINI_INFER_OMP_DEFAULTS=off leaves libgomp's own defaults; any of POLICY_VARS already set
# means the user chose, and nothing here is added.
OPT_OUT_VAR = "MINI_INFER_OMP_DEFAULTS"
POLICY_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def apply_defaults() -> bool:
    """Set DEFAULTS where the environment has no value; False if torch was already imported
    (then libgomp has read its environment and the setting has no effect)."""
    if "torch" in sys.modules:
        return False
    if os.environ.get(OPT_OUT_VAR, "").lower() in ("0", "off", "false"):
        return True  # libgomp's own defaults (the OpenMP benchmark measures them this way)
    if any(name in os.environ for name in POLICY_VARS):
        return True  # the user chose a policy: ours would mix with it
    added = [name for name in DEFAULTS if name not in os.environ]
    for name in added:
        os.environ[name] = DEFAULTS[name]
    if added:
        inherited = [n for n in os.environ.get(SET_BY_ENGINE_VAR, "").split(",") if n]
        os.environ[SET_BY_ENGINE_VAR] = ",".join(dict.fromkeys([*inherited, *added]))
    return True


def environ_before_import() -> dict[str, str]:
    """os.environ without what `import engine` added (here or in a parent process): the
    environment for a process that is not ours (a benchmark peer such as llama-server, whose
    ggml threads are OpenMP threads too and would otherwise run under our policy)."""
    ours = set(os.environ.get(SET_BY_ENGINE_VAR, "").split(",")) | {SET_BY_ENGINE_VAR}
    return {name: value for name, value in os.environ.items() if name not in ours}


APPLIED_AT_IMPORT = apply_defaults()
