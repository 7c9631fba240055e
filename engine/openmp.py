"""OpenMP wait policy: the engine's threads sleep, not spin, while they wait for each other.

torch's CPU kernels run on GNU OpenMP (libgomp, shipped in the torch wheel). At the end of every
parallel region a libgomp thread spins (up to GOMP_SPINCOUNT, 300k iterations by default) before
it sleeps, so that the next region starts without a wake-up. That is right on a machine the
process has to itself, and badly wrong when it does not: a decode step is hundreds of short
parallel regions, and each one whose partner thread has been preempted (by the worker's event
loop, the broker, another process) waits until the spinner's time slice ends.

Measured on the AMD EPYC Zen 4 VM (2 cores, shared with other jobs: load average 6-9), SmolLM2
bf16, greedy, 16 new tokens, each policy in a fresh process, 2 alternating rounds, medians
(tok/s; the absolute numbers are low because the machine was oversubscribed, the ratios are
the finding):

                          1 stream   8 streams
    default (spin)        0.8        10.6
    GOMP_SPINCOUNT=10000  4.3        25.5
    OMP_WAIT_POLICY=PASSIVE 11.6     46.9     (4.4x-14x the default)
    ... plus a busy-loop process on one core:
    default               1.0         4.4
    GOMP_SPINCOUNT=10000  2.1        14.7
    PASSIVE               6.7        32.3

Re-measured with loadtest/bench_omp_policy.py (SmolLM2 bf16, 64 new tokens, W1 = 1 request,
W2 = 32; each policy in a fresh process, 3 alternating rounds, medians; the same shared VM,
load average 3-5 during the run; raw JSON in loadtest/results/omp-wait-policy-bf16.json):

                  W1 tok/s   W2 tok/s
    PASSIVE       15.7       239.0
    ACTIVE         1.2        26.4     PASSIVE / ACTIVE: 13.1x (W1), 9.1x (W2)

Round by round, W1 PASSIVE / ACTIVE was 23.9 / 34.9, 8.3 / 1.1, 15.7 / 1.2: in the first round,
the machine at its quietest, ACTIVE ran one stream 1.46x faster, and lost by 7-13x as soon as
other jobs took the cores; W2 lost 9x even then (29.9 against 278.8). A dedicated machine may
prefer ACTIVE for one stream (set OMP_WAIT_POLICY=ACTIVE: the environment wins); on a shared
one, or beside the worker's event loop and the broker, spinning is the wrong bet.

So PASSIVE is the default here. It must be in the environment before libgomp starts, i.e.
before torch is first imported: `import engine` sets it (unless the variable is already set,
so OMP_WAIT_POLICY=ACTIVE in the environment wins for a dedicated machine), and the model runner
logs a warning when torch was imported first and the default could not apply.
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
