"""End-to-end benchmark: workload W2 through Kafka versus the engine called directly, same run.

W2: 32 distinct chat prompts submitted together, 128 new tokens each, greedy, EOS ignored.
- direct: `LLMEngine` in this process, TTFT measured from submission to the first delta;
- e2e: embedded broker + one `mini-infer serve` worker process + the client SDK in this
  process; TTFT from `send` to the first streamed token on the reply topic.
The two runs never overlap (each owns both cores while it runs). Targets from the issue:
e2e throughput >= 90% of direct, TTFT overhead p50 <= 20 ms. With `--num-requests 1` (W1)
the pair also gives the single-stream inter-token latency of both sides. The worker's peak
RSS (VmHWM, read just before it is stopped) is reported with each Kafka run, and its fused
decode steps by thread count (from its /metrics: how many the thread choice ran on one
thread).

    mini-infer bench e2e [--dtype auto|float32|bfloat16] [--quantization int4] [--kv-cache-dtype int8]
                         [--num-requests 32] [--repeat 3] [--worker-cpus 0-1] [--out r.json] [--plot r.png]

By default everything shares the machine's cores, as on a 2-core box. `--worker-cpus` gives the
engine (both runs) and the worker those CPUs alone and the broker and the client the others: on
a machine with cores to spare, the stand-in for a worker whose broker and clients live on other
machines, as in production.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loadtest.bench_engine import run_engine
from loadtest.llamacpp_peer import peak_rss_of
from loadtest.loadgen_service import scrape_metrics, wait_ready
from loadtest.report import (
    BUNCHED_GAP_S,
    emit,
    gap_after_first_ms,
    percentile,
    summarize,
    token_gaps,
)
from loadtest.workloads import ENGINE_OPTIONS, chat_messages, chat_prompts

GAP_KEYS = ("p50_ms", "p90_ms", "p99_ms", "bunched_share")


def run_direct(model: str, dtype: str, n: int, max_tokens: int, engine_options: dict) -> dict:
    from engine.loader import load_tokenizer

    prompts = chat_prompts(load_tokenizer(Path(model)), n)
    return run_engine(model, dtype, prompts, max_tokens, with_token_gaps=True, **engine_options)


def thread_ids(pid: int) -> list[int]:
    """The threads of `pid` now (Linux: CPU time, nice value, policy and affinity are each a
    thread's own). A thread may end before the caller reaches it."""
    return [int(task.name) for task in Path(f"/proc/{pid}/task").iterdir()]


def _by_thread_name(pid: int, file: str, read) -> dict[str, float]:
    """`read(text)` -> (thread name, value) for /proc/<pid>/task/<tid>/`file` of each thread of
    `pid`, the values summed by thread name."""
    totals: dict[str, float] = {}
    for tid in thread_ids(pid):
        try:
            text = Path(f"/proc/{pid}/task/{tid}/{file}").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        name, value = read(text)
        totals[name] = totals.get(name, 0) + value
    return totals


def _clocks_by_thread(pid: int, field: int) -> dict[str, float] | None:
    """Field `field` of each thread's /proc/<pid>/task/<tid>/schedstat in seconds (0: its time
    on a CPU, 1: its time runnable but waiting for one; the kernel counts both in nanoseconds),
    summed by thread name (`comm`); None where the kernel keeps no schedstat (decided for the
    whole machine, never by a thread that ended between two reads). A thread running while it
    is read shows its time up to its last scheduler tick (one tick late at most); the reading
    thread's own is brought up to date by a yield first."""
    if not Path("/proc/self/schedstat").exists():
        return None
    os.sched_yield()
    totals: dict[str, float] = {}
    for tid in thread_ids(pid):
        task = Path(f"/proc/{pid}/task/{tid}")
        try:
            name = (task / "comm").read_text().rstrip("\n")
            value = int((task / "schedstat").read_text().split()[field]) / 1e9
        except (OSError, IndexError, ValueError):  # ended meanwhile, or an unknown format
            continue
        totals[name] = totals.get(name, 0) + value
    return totals


def cpu_seconds_by_thread(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of `pid`, summed by thread name (the engine's thread is
    "engine"; the event loop runs on the main thread, named after the program). From the
    scheduler's nanosecond clock (schedstat) where the kernel keeps it, else from /proc's
    user + system ticks (10 ms: too coarse for one stream's 128 tokens)."""
    clocks = _clocks_by_thread(pid, 0)
    if clocks is not None:
        return clocks
    ticks = os.sysconf("SC_CLK_TCK")

    def read(stat: str) -> tuple[str, float]:
        name_end = stat.rindex(")")  # a name may hold parentheses itself
        fields = stat[name_end + 2 :].split()
        return stat[stat.index("(") + 1 : name_end], (int(fields[11]) + int(fields[12])) / ticks

    return _by_thread_name(pid, "stat", read)


def run_wait_seconds_by_thread(pid: int) -> dict[str, float]:
    """Seconds each thread of `pid` was runnable but waited for a core (schedstat), summed by
    thread name; empty where the kernel keeps no schedstat. For the engine's threads on cores
    they would otherwise fill, the time other work took from their steps."""
    return _clocks_by_thread(pid, 1) or {}


def wakeups_by_thread(pid: int) -> dict[str, int]:
    """Voluntary context switches of each thread of `pid` (each a sleep that something had to
    end: a wake-up), summed by thread name as `cpu_seconds_by_thread` does. On a virtual
    machine a wake-up can cost far more CPU than the work it wakes for."""

    def read(status: str) -> tuple[str, int]:
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        return fields["Name"].strip(), int(fields["voluntary_ctxt_switches"])

    return _by_thread_name(pid, "status", read)


def by_side(per_thread: dict[str, dict[str, float]]) -> dict[str, float]:
    """Per process and thread name (`cpu_split`'s, or per token) as the tables' sides: the
    engine's threads (the engine thread and the OpenMP threads it started), the worker's others
    (its event loop; a tokenizer thread where there is one), the broker and the client."""
    worker = per_thread.get("worker", {})
    return {
        "engine": worker.get("engine", 0.0),
        "worker": sum(v for name, v in worker.items() if name != "engine"),
        "broker": sum(per_thread.get("broker", {}).values()),
        "client": sum(per_thread.get("client", {}).values()),
    }


def cpu_seconds(pid: int) -> float:
    """CPU seconds of `pid`'s threads, all together (`cpu_seconds_by_thread` summed)."""
    return sum(cpu_seconds_by_thread(pid).values())


def lower_priority(pid: int, niceness: int = 19, idle: bool = False) -> None:
    """Every thread of `pid` (Linux nice values and policies are per thread) at `niceness`,
    and under SCHED_IDLE if `idle`."""
    for tid in thread_ids(pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):  # ended meanwhile
            os.setpriority(os.PRIO_PROCESS, tid, niceness)
            if idle:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))


def parse_cpus(text: str) -> set[int]:
    """CPU ids from a list such as "0,1" or "0-3,8" (the form taskset and /sys use)."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"not a CPU list: {text!r} (e.g. 0,1 or 0-3)")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def split_cpus(worker_cpus: set[int], available: set[int]) -> set[int]:
    """The harness's CPUs: those available that the worker does not have; an error unless the
    worker's are all available and at least one is left over."""
    if not worker_cpus or not worker_cpus <= available:
        raise ValueError(f"worker CPUs {sorted(worker_cpus)} not all in {sorted(available)}")
    harness = available - worker_cpus
    if not harness:
        raise ValueError("--worker-cpus leaves no CPU for the broker and the client")
    return harness


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of `pid` onto `cpus` (affinity is per thread; threads made later inherit
    their creator's)."""
    for tid in thread_ids(pid):
        with contextlib.suppress(ProcessLookupError):  # ended meanwhile
            os.sched_setaffinity(tid, cpus)


def cpu_split(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict:
    """What each process's threads spent during the run, by thread name (after - before): CPU
    seconds, or wake-ups."""
    return {
        process: {
            name: round(seconds - before.get(process, {}).get(name, 0.0), 6)
            for name, seconds in sorted(threads.items())
        }
        for process, threads in after.items()
    }


def beside_engine_us_per_token(cpu: dict[str, dict[str, float]], num_tokens: int) -> dict:
    """CPU microseconds per generated token of what runs beside the engine (`cpu`: `cpu_split`'s
    seconds by process and thread name): the worker's threads other than the engine's (its event
    loop; a tokenizer thread where there is one), the broker and the client. On a machine whose
    cores the engine's threads fill, each of these microseconds comes out of the steps."""
    spent = by_side(cpu)
    del spent["engine"]
    per_token = {k: round(v / max(num_tokens, 1) * 1e6, 1) for k, v in spent.items()}
    per_token["total"] = round(sum(spent.values()) / max(num_tokens, 1) * 1e6, 1)
    return per_token


def cpu_bounds(
    beside_us_per_token: float, engine_cpus: int, direct_tokens_per_s: float,
    direct_itl_ms: float | None,
) -> dict:  # fmt: skip
    """What the CPU taken beside the engine alone allows the through-Kafka run, were it taken
    from the engine's `engine_cpus` cores and nothing else lost (no barrier waits, wake-ups or
    waits for the GIL): each token's `beside_us_per_token` microseconds of other work delay the
    engine by that over its cores. Throughput: 1 / (1 + c * tokens/s / cores) of the direct
    engine's; inter-token latency: 1 + c / (cores * the direct mean gap). A run's ratio beyond
    its bound is what the interleaving itself cost."""
    per_core_s = beside_us_per_token * 1e-6 / max(engine_cpus, 1)
    bounds = {"cpu_bound_throughput_ratio": round(1 / (1 + per_core_s * direct_tokens_per_s), 3)}
    if direct_itl_ms:
        bounds["cpu_bound_itl_ratio"] = round(1 + per_core_s * 1000 / direct_itl_ms, 3)
    return bounds


def worker_counters(metrics_url: str | None) -> tuple[dict[str, float], float]:
    """From the worker's /metrics so far: its fused decode steps by `threads` ("all", "one": the
    thread choice ran them on one thread), and the seconds its engine thread waited for the GIL
    after them; ({}, 0.0) where it has none."""
    if metrics_url is None:
        return {}, 0.0
    series = scrape_metrics(metrics_url)
    steps: dict[str, float] = {}
    for labels, value in series.get("mini_infer_engine_fused_steps_total", []):
        if "threads" in labels:
            steps[labels["threads"]] = steps.get(labels["threads"], 0.0) + value
    gil_wait_s = sum(v for _, v in series.get("mini_infer_engine_gil_wait_seconds_total", []))
    return steps, gil_wait_s


async def run_e2e(
    bootstrap: str, n: int, max_tokens: int, pids: dict[str, int], metrics_url: str | None = None
) -> dict:
    """The measured run; `pids` (worker, broker, client) get their CPU seconds reported, so the
    cost of the transport and of the harness on the same cores is seen beside the engine's, and
    the worker's fused steps by thread count (`metrics_url`: its /metrics)."""
    from worker.client import MiniInferClient

    async with MiniInferClient(bootstrap) as client:
        # Warm-up: waits for the worker to join its group and for the model to be loaded.
        await client.generate(
            messages=chat_messages(0), max_tokens=4, temperature=0.0, timeout_s=600
        )

        arrivals: list[list[float]] = []  # per stream, when each token reached the client

        timings: list[dict] = []  # each final's Timing: where the worker's time went

        async def one(i: int) -> tuple[float, int, float | None, float | None]:
            sent = time.perf_counter()
            ttft, num_tokens, worker_ttft_s, final_transport_s = None, 0, None, None
            times: list[float] = []
            arrivals.append(times)
            async for delta in client.stream(
                messages=chat_messages(i),
                max_tokens=max_tokens,
                temperature=0.0,
                ignore_eos=True,
                timeout_s=600,
            ):
                if delta.token_ids:
                    now = time.perf_counter()
                    if ttft is None:
                        ttft = now - sent
                    times.extend([now] * len(delta.token_ids))
                num_tokens += len(delta.token_ids)
                if delta.final is not None:
                    timing = delta.final.timing
                    timings.append(timing.model_dump(exclude_none=True))
                    if timing.ttft_ms is not None:
                        worker_ttft_s = timing.ttft_ms / 1000
                    # the final's way out (and the request's way in)
                    final_transport_s = time.perf_counter() - sent - timing.total_ms / 1000
            return ttft, num_tokens, worker_ttft_s, final_transport_s

        steps_before, gil_wait_before_s = worker_counters(metrics_url)
        cpu_before = {name: cpu_seconds_by_thread(pid) for name, pid in pids.items()}
        wakeups_before = {name: wakeups_by_thread(pid) for name, pid in pids.items()}
        waits_before = {name: run_wait_seconds_by_thread(pid) for name, pid in pids.items()}
        start = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(n)))
        elapsed = time.perf_counter() - start
        cpu = cpu_split(
            cpu_before, {name: cpu_seconds_by_thread(pid) for name, pid in pids.items()}
        )
        wakeups = cpu_split(
            wakeups_before, {name: wakeups_by_thread(pid) for name, pid in pids.items()}
        )
        waits = cpu_split(
            waits_before, {name: run_wait_seconds_by_thread(pid) for name, pid in pids.items()}
        )
        steps_after, gil_wait_after_s = worker_counters(metrics_url)
    stats = summarize(sum(k for _, k, _, _ in results), elapsed, [t for t, _, _, _ in results])
    stats["cpu_s"] = cpu
    stats["cpu_beside_engine_us_per_token"] = beside_engine_us_per_token(
        cpu, stats["output_tokens"]
    )
    # How long each side's threads were ready to run but found no core free, per token: for
    # the engine's threads, what the work beside them took out of its steps.
    stats["run_wait_us_per_token"] = {
        side: round(seconds / max(stats["output_tokens"], 1) * 1e6, 1)
        for side, seconds in by_side(waits).items()
    }
    stats["wakeups_per_token"] = {
        process: {name: round(k / max(stats["output_tokens"], 1), 2) for name, k in threads.items()}
        for process, threads in wakeups.items()
    }
    if steps_after:  # the steps of this run (the metric is exported once a step has run)
        stats["fused_steps"] = {
            k: int(v - steps_before.get(k, 0.0)) for k, v in sorted(steps_after.items())
        }
        # the engine thread's waits for the GIL after its steps
        stats["gil_wait_ms"] = round((gil_wait_after_s - gil_wait_before_s) * 1000, 1)
    stats["token_gaps"] = token_gaps(arrivals)
    # The worker's own TTFT (from receiving the message to its first token): the rest of the
    # client's TTFT is transport (produce, fetch waits, publish).
    worker_ttfts = [w for _, _, w, _ in results if w is not None]
    if worker_ttfts:
        stats["worker_ttft_p50_ms"] = round(percentile(worker_ttfts, 50) * 1000, 1)
    # The same for the final: the client's time to it less the worker's (from receiving the
    # request to the final). Against the TTFT's share, what the last tokens waited beyond the
    # first's: on busy cores the reply path lags the engine and catches up once it stops.
    final_transports = [f for _, _, _, f in results if f is not None]
    if final_transports:
        stats["final_transport_p50_ms"] = round(percentile(final_transports, 50) * 1000, 1)
        stats["final_transport_max_ms"] = round(max(final_transports) * 1000, 1)
    if timings:  # the worker's stages (batcher, engine queue, prefill, ...), medians
        stats["worker_timing_p50_ms"] = {
            key: round(percentile([t[key] for t in timings if key in t], 50), 1)
            for key in dict.fromkeys(key for t in timings for key in t)  # any final's stages
        }
    return stats


def _harness_priority(args) -> str:
    """How the broker and the client ran beside the worker."""
    if args.idle_harness:
        return "SCHED_IDLE"
    return "nice 19" if args.nice_harness else "as is"


def _client_run(
    bootstrap: str, n: int, max_tokens: int, pids: dict, nice: bool, idle: bool,
    metrics_url: str | None = None, cpus: set[int] | None = None,
) -> dict:  # fmt: skip
    """The measured Kafka run in a child process (the client), at nice 19 if `nice`, under
    SCHED_IDLE too if `idle`, on `cpus` if given."""
    if cpus:
        pin(os.getpid(), cpus)
    if nice or idle:
        lower_priority(os.getpid(), idle=idle)
    pids = {**pids, "client": os.getpid()}
    return asyncio.run(run_e2e(bootstrap, n, max_tokens, pids, metrics_url))


def start_worker(
    bootstrap: str, model: str, dtype: str, ready_file: Path, engine_options: dict
) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "worker.cli", "serve", "--bootstrap-servers", bootstrap,
           "--model", model, "--dtype", dtype, "--log-level", "warning",
           "--ready-file", str(ready_file), "--health-port", "0"]  # fmt: skip
    engine_options = dict(engine_options)
    if quantization := engine_options.pop("quantization", None):
        cmd += ["--quantization", quantization]
    options = {**ENGINE_OPTIONS, **engine_options}
    engine_env = {f"MINI_INFER_ENGINE__{k.upper()}": str(v) for k, v in options.items()}
    return subprocess.Popen(cmd, env={**os.environ, **engine_env, "PYTHONUNBUFFERED": "1"})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument(
        "--dtype",
        default="auto",
        help="auto (the default of serve and LLMEngine) | float32 | bfloat16",
    )
    parser.add_argument("--quantization", default=None, help="int8 | int4 | w8a8 (both sides)")
    parser.add_argument("--kv-cache-dtype", default=None, help="auto | int8 (both sides)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument(
        "--num-threads", type=int, default=None,
        help="torch threads of the engine, both runs (default: torch's, one per core); fewer "
        "than the cores leaves the broker, client and worker I/O a core of their own",
    )  # fmt: skip
    parser.add_argument(
        "--repeat", type=int, default=3,
        help="direct/Kafka pairs to run; the summary is their median (a W2 run is one TTFT sample)",
    )  # fmt: skip
    parser.add_argument(
        "--nice-harness", action=argparse.BooleanOptionalAction, default=True,
        help="run the broker and the client at nice 19 during the Kafka run (default): in "
        "production they live on other machines; here they share the worker's cores, and each "
        "preemption of an engine thread stalls both at the step's next barrier",
    )  # fmt: skip
    parser.add_argument(
        "--idle-harness", action="store_true",
        help="the broker and the client under SCHED_IDLE as well (a nearer stand-in for other "
        "machines than nice 19: they run only on a core the worker leaves); not the default, "
        "so that runs compare with earlier ones",
    )  # fmt: skip
    parser.add_argument(
        "--worker-cpus", type=parse_cpus, default=None,
        help="CPUs (e.g. 0-1) for the engine in both runs and for the worker, the rest for the "
        "broker and the client: the harness off the worker's cores, as on other machines in "
        "production (needs more cores than the worker's); engine threads default to their count",
    )  # fmt: skip
    parser.add_argument(
        "--floor", action="store_true",
        help="after each pair, the Kafka transport's floor in a fresh process, one round: the "
        "engine alone and beside a bare producer on a loop thread, the broker and a consumer, "
        "no worker (loadtest/bench_transport_floor.py, side `thread`); what the worker itself "
        "could still remove is the pair's ratio against the floor's",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None, help="TTFT distribution plot (PNG)")


def floor_command(args, model: str, out: Path) -> list[str]:
    """`bench_transport_floor` for this run's workload and engine settings, one round."""
    command = [
        sys.executable, "-m", "loadtest.bench_transport_floor", "--sides", "none,thread",
        "--rounds", "1", "--num-streams", str(args.num_requests),
        "--num-tokens", str(args.max_tokens), "--model", model, "--dtype", args.dtype,
        "--out", str(out),
    ]  # fmt: skip
    for flag, value in (("--quantization", args.quantization),
                        ("--kv-cache-dtype", args.kv_cache_dtype),
                        ("--num-threads", args.num_threads)):  # fmt: skip
        if value is not None:
            command += [flag, str(value)]
    return command


def floor_ratios(doc: dict) -> dict:
    """The floor's ratios to the engine alone, from `bench_transport_floor`'s JSON (one round)."""
    side = doc["rounds"][0]["thread"]
    return {
        "floor_throughput_ratio": side["throughput_ratio"],
        "floor_itl_ratio": side["itl_ratio"],
        "floor_messages_read": side["messages_read"],
        "floor_num_tokens": side["num_tokens"],
    }


def run_floor(args, model: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "floor.json"
        print("[bench] the transport's floor ...", file=sys.stderr, flush=True)
        subprocess.run(floor_command(args, model, out), check=True, stdout=subprocess.DEVNULL)
        return floor_ratios(json.loads(out.read_text()))


def run_pair(args, model: str, engine_options: dict) -> dict:
    """One direct run, then one run through Kafka (a fresh broker and worker)."""
    from worker.broker import EmbeddedBroker

    harness_cpus = args.harness_cpus
    if args.worker_cpus:  # this process (the direct engine) and the worker it starts
        pin(os.getpid(), args.worker_cpus)
    print("[bench] direct engine ...", file=sys.stderr, flush=True)
    direct = run_direct(model, args.dtype, args.num_requests, args.max_tokens, engine_options)
    print("[bench] through Kafka ...", file=sys.stderr, flush=True)
    with EmbeddedBroker() as broker, tempfile.TemporaryDirectory() as tmp:
        worker = start_worker(
            broker.bootstrap_servers, model, args.dtype, Path(tmp) / "ready", engine_options
        )
        try:
            asyncio.run(wait_ready(worker, Path(tmp) / "ready"))
            health_port = json.loads((Path(tmp) / "ready").read_text()).get("health_port")
            metrics_url = f"http://127.0.0.1:{health_port}/metrics" if health_port else None
            pids = {"worker": worker.pid, "broker": broker.pid}
            if harness_cpus:
                pin(broker.pid, harness_cpus)
            if args.nice_harness or args.idle_harness:  # they take what the worker leaves
                lower_priority(broker.pid, idle=args.idle_harness)
            # The client in a process of its own, lowered there: lowered here, this process
            # stayed at nice 19, and every later pair's worker and broker inherited it (each
            # pair after the first measured a worker at the harness's priority).
            with multiprocessing.get_context("spawn").Pool(1) as pool:
                e2e = pool.apply(
                    _client_run,
                    (broker.bootstrap_servers, args.num_requests, args.max_tokens, pids,
                     args.nice_harness, args.idle_harness, metrics_url, harness_cpus),
                )  # fmt: skip
            e2e["worker_peak_rss_mib"] = peak_rss_of(worker.pid)
        finally:
            worker.send_signal(signal.SIGTERM)
            worker.wait(timeout=60)
    pair = {
        "direct": direct,
        "e2e": e2e,
        "throughput_ratio_e2e_over_direct": round(e2e["tokens_per_s"] / direct["tokens_per_s"], 3),
        "ttft_overhead_p50_ms": round(e2e["ttft_p50_ms"] - direct["ttft_p50_ms"], 1),
        "ttft_overhead_p99_ms": round(e2e["ttft_p99_ms"] - direct["ttft_p99_ms"], 1),
    }
    if args.num_requests == 1:  # one stream: its mean gap between tokens after the first
        for side, stats in (("direct", direct), ("e2e", e2e)):
            gap_ms = gap_after_first_ms(stats["elapsed_s"], stats["ttft_p50_ms"],
                                        stats["output_tokens"])  # fmt: skip
            pair[f"itl_{side}_ms"] = round(gap_ms, 2)
        pair["itl_ratio_e2e_over_direct"] = round(pair["itl_e2e_ms"] / pair["itl_direct_ms"], 3)
    if beside := e2e.get("cpu_beside_engine_us_per_token"):
        # On the engine's cores: everything but the engine's own threads; with --worker-cpus
        # the broker and the client run on the others, and only the worker's loop counts.
        engine_cpus = len(args.worker_cpus) if args.worker_cpus else len(os.sched_getaffinity(0))
        taken = beside["worker"] if args.worker_cpus else beside["total"]
        pair.update(
            cpu_bounds(taken, engine_cpus, direct["tokens_per_s"], pair.get("itl_direct_ms"))
        )
    # How the tokens came: the mean gap above cannot tell a steady stream from bursts.
    for side, stats in (("direct", direct), ("e2e", e2e)):
        gaps = stats.get("token_gaps") or {}
        for key in GAP_KEYS:
            if key in gaps:
                pair[f"gap_{side}_{key}"] = gaps[key]
    if "worker_ttft_p50_ms" in e2e:
        # Kafka's share of the overhead: from the worker's first token to the client's, plus
        # the request's way in. The rest is the worker's own prefill against the direct one's.
        pair["ttft_transport_p50_ms"] = round(e2e["ttft_p50_ms"] - e2e["worker_ttft_p50_ms"], 1)
    if "final_transport_p50_ms" in e2e:
        pair["final_transport_p50_ms"] = e2e["final_transport_p50_ms"]
        pair["final_transport_max_ms"] = e2e["final_transport_max_ms"]
    return pair


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mini-infer bench e2e", description=__doc__.split("\n\n")[0]
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    from engine.loader import resolve_model

    model = str(resolve_model(args.model))
    if args.floor and args.worker_cpus:
        parser.error("--floor runs on every CPU: not with --worker-cpus")
    # The harness's CPUs: those this process may use, less the worker's (None: all shared).
    args.harness_cpus = None
    if args.worker_cpus:
        args.harness_cpus = split_cpus(args.worker_cpus, os.sched_getaffinity(0))
        if args.num_threads is None:
            args.num_threads = len(args.worker_cpus)
    engine_options = {} if args.num_threads is None else {"num_threads": args.num_threads}
    if args.quantization:
        engine_options["quantization"] = args.quantization
    if args.kv_cache_dtype:
        engine_options["kv_cache_dtype"] = args.kv_cache_dtype
    pairs = []
    for i in range(args.repeat):
        print(f"[bench] pair {i + 1}/{args.repeat}", file=sys.stderr, flush=True)
        pairs.append(run_pair(args, model, engine_options))
        if args.floor:
            pairs[-1].update(run_floor(args, model))
    keys = ("floor_throughput_ratio", "floor_itl_ratio", "throughput_ratio_e2e_over_direct", "ttft_overhead_p50_ms", "ttft_overhead_p99_ms",
            "ttft_transport_p50_ms", "final_transport_p50_ms", "itl_direct_ms", "itl_e2e_ms", "itl_ratio_e2e_over_direct", "cpu_bound_throughput_ratio", "cpu_bound_itl_ratio",
            *(f"gap_{side}_{k}" for side in ("direct", "e2e") for k in GAP_KEYS))  # fmt: skip
    doc = {
        "workload": f"{args.num_requests} chat prompts x {args.max_tokens} tokens, greedy, no EOS",
        "dtype": args.dtype,
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype or "auto",
        "engine_threads": args.num_threads or "torch default",
        "cpu_count": os.cpu_count(),
        "harness": _harness_priority(args),
        "worker_cpus": sorted(args.worker_cpus) if args.worker_cpus else "all",
        "harness_cpus": sorted(args.harness_cpus) if args.harness_cpus else "all",
        "repeat": args.repeat,
        # All 32 first tokens come from one prefill step, so each run is one TTFT sample: back
        # to back, the same direct run's prefill measured 535-680 ms. Hence the median of pairs.
        **{k: statistics.median(p[k] for p in pairs) for k in keys if all(k in p for p in pairs)},
        "pairs": pairs,
        # The median pair by throughput ratio, for the table and the plot.
        **{k: v for k, v in _median_pair(pairs).items() if k in ("direct", "e2e")},
    }
    print(f"{'pair':>4} {'direct tok/s':>13} {'e2e tok/s':>10} {'ratio':>6} {'TTFT +p50':>10} "
          f"{'transport':>10}")  # fmt: skip
    for i, p in enumerate(pairs):
        print(f"{i + 1:>4} {p['direct']['tokens_per_s']:>13.1f} {p['e2e']['tokens_per_s']:>10.1f} "
              f"{p['throughput_ratio_e2e_over_direct']:>6.3f} {p['ttft_overhead_p50_ms']:>8.1f}ms "
              f"{p.get('ttft_transport_p50_ms', float('nan')):>8.1f}ms")  # fmt: skip
    print(f"median of {args.repeat}: e2e/direct throughput "
          f"{doc['throughput_ratio_e2e_over_direct']:.3f}; TTFT overhead p50 "
          f"{doc['ttft_overhead_p50_ms']} ms, p99 {doc['ttft_overhead_p99_ms']} ms (transport p50 "
          f"{doc.get('ttft_transport_p50_ms', 'n/a')} ms; the final's p50 "
          f"{doc.get('final_transport_p50_ms', 'n/a')} ms)")  # fmt: skip
    if args.floor:
        print(f"the transport's floor (no worker), medians: throughput "
              f"{doc['floor_throughput_ratio']:.3f}, ITL {doc['floor_itl_ratio']:.3f}; through the "
              f"worker: throughput {doc['throughput_ratio_e2e_over_direct']:.3f}"
              + (f", ITL {doc['itl_ratio_e2e_over_direct']:.3f}"
                 if "itl_ratio_e2e_over_direct" in doc else ""))  # fmt: skip
    for i, p in enumerate(pairs):
        steps = p["e2e"].get("fused_steps")
        if steps:
            print(f"pair {i + 1}: the worker's fused decode steps on one thread (the thread "
                  f"choice): {steps.get('one', 0)} of {steps.get('one', 0) + steps.get('all', 0)}; "
                  f"its engine thread waited {p['e2e'].get('gil_wait_ms', 0.0)} ms for the GIL "
                  f"after them")  # fmt: skip
    print("CPU beside the engine per token, us (worker: its threads but the engine's; the "
          "scheduler's clocks, or /proc's 10 ms ticks where it keeps none); the engine's threads' "
          "wait for a core per token, us (e:wait); wake-ups per token (voluntary context "
          "switches: the engine's threads, the worker's others, the broker, the client)")  # fmt: skip
    print(f"{'pair':>4} {'worker':>7} {'broker':>7} {'client':>7} {'total':>7} {'e:wait':>7}   "
          f"{'w:engine':>8} {'w:worker':>8} {'w:broker':>8} {'w:client':>8}   "
          f"{'ratio':>6} {'bound':>6}")  # fmt: skip
    key = (
        "itl_ratio_e2e_over_direct"
        if args.num_requests == 1
        else "throughput_ratio_e2e_over_direct"
    )
    bound_key = "cpu_bound_itl_ratio" if args.num_requests == 1 else "cpu_bound_throughput_ratio"
    for i, p in enumerate(pairs):
        if c := p["e2e"].get("cpu_beside_engine_us_per_token"):
            w = by_side(p["e2e"].get("wakeups_per_token", {}))
            wait = p["e2e"].get("run_wait_us_per_token", {}).get("engine", float("nan"))
            print(f"{i + 1:>4} {c['worker']:>7.0f} {c['broker']:>7.0f} {c['client']:>7.0f} "
                  f"{c['total']:>7.0f} {wait:>7.0f}   {w['engine']:>8.2f} {w['worker']:>8.2f} "
                  f"{w['broker']:>8.2f} {w['client']:>8.2f}   {p[key]:>6.3f} "
                  f"{p.get(bound_key, float('nan')):>6.3f}")  # fmt: skip
    print(
        "bound: the ratio the CPU beside the engine alone allows, were it taken from the "
        "engine's cores and nothing else lost; past it, the interleaving's own cost"
    )
    print(f"gaps between a stream's tokens as its reader got them, ms (bunched: within "
          f"{BUNCHED_GAP_S * 1000:g} ms of the one before)")  # fmt: skip
    print(f"{'pair':>4} {'side':>7} {'p50':>8} {'p90':>8} {'p99':>8} {'bunched':>8}")
    for i, p in enumerate(pairs):
        for side in ("direct", "e2e"):
            if f"gap_{side}_p50_ms" in p:
                print(f"{i + 1:>4} {side:>7} {p[f'gap_{side}_p50_ms']:>8.2f} "
                      f"{p[f'gap_{side}_p90_ms']:>8.2f} {p[f'gap_{side}_p99_ms']:>8.2f} "
                      f"{p[f'gap_{side}_bunched_share']:>8.3f}")  # fmt: skip
    emit(doc, args.out, args.plot, lambda plt: _draw(doc, plt))
    return 0


def _median_pair(pairs: list[dict]) -> dict:
    ordered = sorted(pairs, key=lambda p: p["throughput_ratio_e2e_over_direct"])
    return ordered[(len(ordered) - 1) // 2]


def _draw(doc: dict, plt):
    fig, (ax, gap_ax) = plt.subplots(1, 2, figsize=(12, 4))
    for name in ("direct", "e2e"):
        xs = doc[name]["ttfts_ms"]
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name)
    ax.set_xlabel("time to first token (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(
        f"TTFT CDF, {doc['workload']}\n(the median of {doc['repeat']} pairs by throughput ratio)"
    )
    ax.legend()
    for name in ("direct", "e2e"):
        cdf = doc[name].get("token_gaps", {}).get("cdf_ms")
        if cdf:  # a floor of 1 us so that bunched tokens show on the log axis
            gap_ax.plot([max(x, 1e-3) for x in cdf], [q / 100 for q in range(101)], label=name)
    gap_ax.set_xscale("log")
    gap_ax.set_xlabel("gap between a stream's consecutive tokens as its reader got them (ms)")
    gap_ax.set_ylabel("fraction of gaps")
    gap_ax.set_title("inter-token gaps: the same mean, steady or in bursts")
    gap_ax.legend()
    return fig


if __name__ == "__main__":
    sys.exit(main())
