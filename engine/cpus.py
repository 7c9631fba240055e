"""How many CPUs this process may keep busy: its CPU affinity, and a cgroup CPU quota if one is set
(a container's `--cpus`, a Kubernetes CPU limit).

Two uses. The engine's default thread count: torch starts one thread per CPU of the affinity
and knows nothing of a quota, so `docker run --cpus 2` on a 16-CPU host ran 16 threads in a
2-CPU budget, each step throttled (engine/platform.py `tune_process`). And the worker lowers
its event loop's priority below the engine's threads only where the engine leaves it room
(worker/service/worker.py `loop_priority`): with one CPU, an engine thread that never sleeps
while it generates holds it, and the loop (which streams the tokens) ran about once a second.

Linux only; elsewhere the affinity is `os.cpu_count()` and there is no quota. cgroup v2 (one
`0::` line in /proc/self/cgroup, `cpu.max` files) and v1 (the `cpu` controller's
`cpu.cfs_quota_us` and `cpu.cfs_period_us`) are read, from the process's own group up to the
root: the lowest quota on the way is the one that throttles it.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def parse_cpu_max(text: str) -> float | None:
    """cgroup v2 `cpu.max` ("max 100000", "150000 100000") as CPUs; None: no quota or unreadable."""
    parts = text.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    return _ratio(parts[0], parts[1])


def parse_cfs(quota_text: str, period_text: str) -> float | None:
    """cgroup v1 `cpu.cfs_quota_us` over `cpu.cfs_period_us` as CPUs; None: -1 (no quota) or
    unreadable."""
    return _ratio(quota_text.strip(), period_text.strip())


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def cgroup_quota(proc_cgroup: str, root: Path = CGROUP_ROOT) -> float | None:
    """The lowest CPU quota, in CPUs, on the way from the process's group (`proc_cgroup`: the
    text of /proc/self/cgroup) up to `root`; None where there is none."""
    quotas: list[float] = []
    for line in proc_cgroup.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if not path.startswith("/"):
            continue
        if hierarchy == "0" and controllers == "":  # v2: the unified hierarchy
            for group in _up_from(root, path):
                quota = parse_cpu_max(_read(group / "cpu.max"))
                if quota is not None:
                    quotas.append(quota)
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's own mount
            mount = root / controllers
            if not mount.is_dir():
                mount = root / "cpu"
            for group in _up_from(mount, path):
                quota = parse_cfs(
                    _read(group / "cpu.cfs_quota_us"), _read(group / "cpu.cfs_period_us")
                )
                if quota is not None:
                    quotas.append(quota)
    return min(quotas) if quotas else None


def _up_from(mount: Path, path: str) -> list[Path]:
    """`mount/path` and each of its parents up to `mount` (a path that leaves it stops there)."""
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        return [mount]
    return [mount.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return ""


def cpu_budget() -> int:
    """Whole CPUs this process can use at once: its affinity, capped by a cgroup quota (rounded
    down, at least 1)."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = os.cpu_count() or 1
    quota = cgroup_quota(_read(Path("/proc/self/cgroup")))
    if quota is None:
        return max(affinity, 1)
    return max(1, min(affinity, math.floor(quota)))
