"""What a wake-up costs on this machine: the thread CPU time of one sleep-and-wake, by how long
the thread slept.

A token through the worker wakes several threads (the event loop, the broker's, the client's,
the engine's second thread between steps). On bare metal a wake-up costs a few microseconds of
CPU; on some virtual machines it costs far more, and more the longer the thread slept (the
vCPU halted meanwhile, and the code it runs next finds its caches and TLB cold). On the 2-core
VM of loadtest/JOURNAL.md an asyncio loop woken every 20 ms spent ~220 us of CPU per wake-up
doing nothing else. Run this before comparing per-token CPU figures across machines.

For each sleep length: `--n` sleeps of a plain thread (`time.sleep`) and of an asyncio loop
(`asyncio.sleep`, one `_run_once` per wake-up), the thread CPU per wake-up (CLOCK_THREAD_CPUTIME)
and the wall time per wake-up beyond the sleep asked for (the wake-up's latency).

    python -m loadtest.bench_wake_cost [--sleeps-ms 0.1,1,5,20] [--n 200] [--out r.json]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from loadtest.report import emit


def thread_sleeps(sleep_s: float, n: int) -> dict:
    cpu, wall = time.thread_time(), time.perf_counter()
    for _ in range(n):
        time.sleep(sleep_s)
    return _per_wake(cpu, wall, sleep_s, n)


async def _loop_sleeps(sleep_s: float, n: int) -> dict:
    cpu, wall = time.thread_time(), time.perf_counter()
    for _ in range(n):
        await asyncio.sleep(sleep_s)
    return _per_wake(cpu, wall, sleep_s, n)


def loop_sleeps(sleep_s: float, n: int) -> dict:
    return asyncio.run(_loop_sleeps(sleep_s, n))


def _per_wake(cpu_start: float, wall_start: float, sleep_s: float, n: int) -> dict:
    cpu_s, wall_s = time.thread_time() - cpu_start, time.perf_counter() - wall_start
    return {
        "cpu_us_per_wake": round(cpu_s / n * 1e6, 1),
        "latency_us_per_wake": round((wall_s / n - sleep_s) * 1e6, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sleeps-ms", default="0.1,1,5,20")
    parser.add_argument("--n", type=int, default=200, help="wake-ups per measurement")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    sleeps_ms = [float(s) for s in args.sleeps_ms.split(",")]
    rows = []
    print(f"{'sleep ms':>9} {'thread CPU us':>14} {'latency us':>11} {'loop CPU us':>12} "
          f"{'latency us':>11}   (per wake-up, {args.n} each)")  # fmt: skip
    for sleep_ms in sleeps_ms:
        plain = thread_sleeps(sleep_ms / 1000, args.n)
        loop = loop_sleeps(sleep_ms / 1000, args.n)
        rows.append({"sleep_ms": sleep_ms, "thread": plain, "asyncio": loop})
        print(f"{sleep_ms:>9g} {plain['cpu_us_per_wake']:>14.1f} "
              f"{plain['latency_us_per_wake']:>11.1f} {loop['cpu_us_per_wake']:>12.1f} "
              f"{loop['latency_us_per_wake']:>11.1f}")  # fmt: skip
    emit({"n": args.n, "rows": rows}, args.out, None, None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
