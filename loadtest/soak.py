"""Soak: one worker under moderate mixed-urgency load for N minutes, watched for slow leaks.

An embedded broker and one `mini-infer serve` process; Poisson arrivals of requests with
`critical`/`high`/`normal`/`low` urgency headers, some cancelled mid-flight and some given a
short deadline. Every `--sample-s` seconds the worker process's RSS (/proc/<pid>/status) and open
file descriptors (/proc/<pid>/fd) are sampled, with the engine's KV blocks in use (the worker's
/metrics gauge); each `--window-s` window gives TTFT and end-to-end latency p50/p99 of the
requests that finished in it. At the end, once idle, the blocks still in use are the leaked ones.

The worker's KV pool is committed at start (`kv_cache_prefault`), as a production worker that
wants a flat RSS would run it: otherwise the pool's pages are committed as blocks are first
used and, with prefix caching, the pool fills with cached prefixes, so RSS climbs towards
"baseline + pool size" (512 MiB by default: bounded, by design) and that climb hides a real
leak. `--lazy-pool` runs without it, to watch that climb.

Writes JSON under loadtest/results/ and a PNG of the curves, and prints the verdict: RSS and fd
slopes over the second half (after warm-up), leaked KV blocks, p99 TTFT of the last window
against the first. Not part of `make test` (it takes minutes); tests/loadtest/test_soak.py runs
it for seconds with a tiny model.

    mini-infer soak --minutes 10            # smollm2-135m, bfloat16 (= python -m loadtest.soak)

Results (see loadtest/README.md, "Soak"), measured on the 2-core AMD EPYC Zen 4 VM with other
jobs sharing it: recorded there with the PNG path. `--rescore results.json` recomputes the
verdict and the PNG of a saved run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from loadtest.loadgen_service import (
    default_num_threads,
    kafka_settings,
    make_client,
    scrape_metrics,
    wait_ready,
)
from loadtest.report import percentile
from loadtest.workloads import ENGINE_OPTIONS

RESULTS = Path(__file__).parent / "results"
URGENCY_MIX = (("critical", 0.1), ("high", 0.2), ("normal", 0.5), ("low", 0.2))
PROMPTS = (
    "Write a short note about the sea.",
    "List three uses of a paper clip.",
    "Explain what a queue is, briefly.",
    "Give me a haiku about autumn leaves.",
    "What is the capital of France? Answer in one sentence.",
)


@dataclass
class Outcome:
    sent_s: float  # since the start of the run
    urgency: str
    kind: str  # "plain" | "cancel" | "deadline"
    finish_reason: str | None = None  # None: the client gave up (timeout) or an error
    ttft_s: float | None = None
    e2e_s: float | None = None
    done_s: float | None = None  # since the start of the run
    error: str | None = None


@dataclass
class Sample:
    t_s: float
    rss_mib: float
    num_fds: int
    kv_blocks_used: float | None
    num_in_flight: int


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def num_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def kv_blocks(port: int) -> tuple[float | None, float | None]:
    """(used, total) from the worker's /metrics; None where the gauge is not there yet."""
    try:
        samples = scrape_metrics(f"http://127.0.0.1:{port}/metrics", timeout_s=5)
    except OSError:
        return None, None

    def first(name: str) -> float | None:
        found = samples.get(name)
        return found[0][1] if found else None

    return first("mini_infer_kv_cache_blocks_used"), first("mini_infer_kv_cache_blocks_total")


def slope_per_min(points: list[tuple[float, float]]) -> float:
    """Least-squares slope (units per minute) of (t_s, value) points."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    var_t = sum((t - mean_t) ** 2 for t, _ in points)
    if var_t == 0:
        return 0.0
    return 60.0 * sum((t - mean_t) * (v - mean_v) for t, v in points) / var_t


def window_latencies(outcomes: list[Outcome], window_s: float, duration_s: float) -> list[dict]:
    """p50/p99 of TTFT and end-to-end latency of the requests served in each window."""
    windows = []
    num_windows = max(1, int(duration_s // window_s + (duration_s % window_s > 1)))
    for i in range(num_windows):
        start_s, end_s = i * window_s, (i + 1) * window_s
        served = [
            o for o in outcomes
            if o.done_s is not None and start_s <= o.done_s < end_s
            and o.finish_reason in ("stop", "length")
        ]  # fmt: skip
        ttfts = [o.ttft_s * 1000 for o in served if o.ttft_s is not None]
        e2es = [o.e2e_s * 1000 for o in served if o.e2e_s is not None]
        windows.append({
            "start_s": start_s, "num_served": len(served),
            "ttft_p50_ms": round(percentile(ttfts, 50), 1) if ttfts else None,
            "ttft_p99_ms": round(percentile(ttfts, 99), 1) if ttfts else None,
            "e2e_p50_ms": round(percentile(e2es, 50), 1) if e2es else None,
            "e2e_p99_ms": round(percentile(e2es, 99), 1) if e2es else None,
        })  # fmt: skip
    return windows


def verdict(samples: list[Sample], windows: list[dict], leaked_blocks, duration_s: float) -> dict:
    """Flat RSS and fds over the second half (the first is warm-up: allocator pools, caches),
        no KV blocks in use once idle, and p99 TTFT of the last window within 2x of the first (the
    first after the warm-up window, when there are three or more)."""
    second_half = [s for s in samples if s.t_s >= duration_s / 2] or samples
    rss_slope = slope_per_min([(s.t_s, s.rss_mib) for s in second_half])
    fd_slope = slope_per_min([(s.t_s, s.num_fds) for s in second_half])
    mean_rss = sum(s.rss_mib for s in second_half) / len(second_half)
    half_min = duration_s / 120
    # Flat: what the slope would add over the second half is under 2% of RSS (or 5 MiB).
    rss_growth_mib = rss_slope * half_min
    is_rss_flat = rss_growth_mib < max(5.0, 0.02 * mean_rss)
    first_half = [s for s in samples if s.t_s < duration_s / 2] or samples
    is_fd_flat = max(s.num_fds for s in second_half) <= max(s.num_fds for s in first_half) + 2
    timed = [w for w in windows if w["ttft_p99_ms"] is not None]
    if len(timed) >= 3:  # the first window holds the warm-up (first steps, allocator growth)
        timed = timed[1:]
    p99_first = timed[0]["ttft_p99_ms"] if timed else None
    p99_last = timed[-1]["ttft_p99_ms"] if timed else None
    p99_ratio = round(p99_last / p99_first, 2) if p99_first else None
    is_p99_stable = p99_ratio is not None and p99_ratio <= 2.0
    return {
        "rss_slope_mib_per_min": round(rss_slope, 3),
        "rss_growth_second_half_mib": round(rss_growth_mib, 2),
        "rss_mean_mib": round(mean_rss, 1),
        "rss_flat": is_rss_flat,
        "fd_slope_per_min": round(fd_slope, 3),
        "fds_flat": is_fd_flat,
        "leaked_kv_blocks": leaked_blocks,
        "no_leaked_blocks": leaked_blocks == 0,
        "ttft_p99_first_window_ms": p99_first,
        "ttft_p99_last_window_ms": p99_last,
        "ttft_p99_last_over_first": p99_ratio,
        "p99_stable": is_p99_stable,
        "ok": is_rss_flat and is_fd_flat and leaked_blocks == 0 and is_p99_stable,
    }


async def one_request(client, args, rng: random.Random, started_s: float) -> Outcome:
    urgency = rng.choices([u for u, _ in URGENCY_MIX], [w for _, w in URGENCY_MIX])[0]
    roll = rng.random()
    kind = "cancel" if roll < args.cancel_fraction else (
        "deadline" if roll < args.cancel_fraction + args.deadline_fraction else "plain"
    )  # fmt: skip
    outcome = Outcome(sent_s=time.monotonic() - started_s, urgency=urgency, kind=kind)
    request_id = uuid.uuid4().hex
    sampling: dict = {"max_tokens": rng.randint(args.min_tokens, args.max_tokens),
                      "temperature": 0.7, "seed": rng.randrange(1 << 30)}  # fmt: skip
    if kind == "deadline":  # some expire mid-generation, some make it
        sampling["deadline_ms"] = int((time.time() + rng.uniform(0.3, 3.0)) * 1000)
    canceller = None
    if kind == "cancel":

        async def cancel_later() -> None:
            await asyncio.sleep(rng.uniform(0.1, 2.0))
            await client.cancel(request_id)

        canceller = asyncio.create_task(cancel_later())
    sent_s = time.monotonic()
    try:
        async for delta in client.stream(
            rng.choice(PROMPTS), urgency=urgency, request_id=request_id,
            timeout_s=args.request_timeout_s, **sampling,
        ):  # fmt: skip
            if outcome.ttft_s is None and delta.text:
                outcome.ttft_s = time.monotonic() - sent_s
            if delta.final is not None:
                outcome.finish_reason = delta.final.finish_reason
    except Exception as error:  # a timeout or an error final: recorded, the soak goes on
        outcome.error = f"{type(error).__name__}: {error}"[:200]
    finally:
        if canceller is not None:
            canceller.cancel()
    outcome.e2e_s = time.monotonic() - sent_s
    outcome.done_s = time.monotonic() - started_s
    return outcome


@contextlib.asynccontextmanager
async def soak_service(args):
    """An embedded broker and one worker process; yields (bootstrap, process, health port)."""
    from worker.broker import EmbeddedBroker

    async with EmbeddedBroker() as broker:
        with tempfile.TemporaryDirectory() as tmp:
            ready_file, port = Path(tmp) / "ready", free_port()
            options = {**ENGINE_OPTIONS, "num_threads": default_num_threads(),
                       "kv_cache_prefault": not args.lazy_pool}  # fmt: skip
            env = {f"MINI_INFER_ENGINE__{k.upper()}": str(v) for k, v in options.items()}
            env["MINI_INFER_KAFKA__ENABLE_IDEMPOTENCE"] = "false"  # the embedded broker lacks it
            command = [sys.executable, "-m", "worker.cli", "serve",
                       "--bootstrap-servers", broker.bootstrap_servers, "--model", args.model,
                       "--dtype", args.dtype, "--log-level", "warning",
                       "--ready-file", str(ready_file), "--health-port", str(port)]  # fmt: skip
            worker = subprocess.Popen(command, env={**os.environ, **env})
            try:
                await wait_ready(worker, ready_file)
                yield broker.bootstrap_servers, worker, port
            finally:
                worker.send_signal(signal.SIGTERM)
                await asyncio.to_thread(worker.wait, 60)


async def run(args) -> dict:
    duration_s = args.minutes * 60
    rng = random.Random(args.seed)
    samples: list[Sample] = []
    outcomes: list[Outcome] = []
    async with soak_service(args) as (bootstrap, worker, port):
        kafka = kafka_settings(
            argparse.Namespace(request_topic=None, control_topic=None), bootstrap
        )
        async with make_client(kafka) as client:
            in_flight: set[asyncio.Task] = set()
            started_s = time.monotonic()

            async def sample_forever() -> None:
                while True:
                    used, _ = await asyncio.to_thread(kv_blocks, port)
                    samples.append(Sample(
                        round(time.monotonic() - started_s, 2), round(rss_mib(worker.pid), 2),
                        num_fds(worker.pid), used, len(in_flight),
                    ))  # fmt: skip
                    await asyncio.sleep(args.sample_s)

            sampler = asyncio.create_task(sample_forever())
            while time.monotonic() - started_s < duration_s:
                task = asyncio.create_task(one_request(client, args, rng, started_s))
                in_flight.add(task)
                task.add_done_callback(
                    lambda t: (in_flight.discard(t), outcomes.append(t.result()))
                )
                await asyncio.sleep(rng.expovariate(args.rate))
            await asyncio.gather(*in_flight, return_exceptions=True)
            # Idle: every block should be free again. The gauge moves on engine steps, so a
            # one-token probe makes one step happen after everything else finished.
            await asyncio.sleep(2.0)
            await client.generate("probe", max_tokens=1, temperature=0.0)
            await asyncio.sleep(2.0)
            leaked, total = await asyncio.to_thread(kv_blocks, port)
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
        elapsed_s = time.monotonic() - started_s
    windows = window_latencies(outcomes, args.window_s, duration_s)
    reasons: dict[str, int] = {}
    for o in outcomes:
        key = o.finish_reason or "client_error"
        reasons[key] = reasons.get(key, 0) + 1
    return {
        "benchmark": "soak",
        "model": args.model,
        "dtype": args.dtype,
        "minutes": args.minutes,
        "kv_pool": "lazy" if args.lazy_pool else "prefault",
        "rate_per_s": args.rate,
        "elapsed_s": round(elapsed_s, 1),
        "num_requests": len(outcomes),
        "finish_reasons": reasons,
        "kv_blocks_total": total,
        "verdict": verdict(samples, windows, leaked, duration_s),
        "windows": windows,
        "samples": [asdict(s) for s in samples],
        "errors": sorted({o.error for o in outcomes if o.error})[:20],
    }


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples, windows = doc["samples"], doc["windows"]
    minutes = [s["t_s"] / 60 for s in samples]
    fig, axes = plt.subplots(2, 2, figsize=(12, 7))
    axes[0][0].plot(minutes, [s["rss_mib"] for s in samples])
    axes[0][0].set(title="worker RSS", xlabel="minutes", ylabel="MiB")
    axes[0][1].plot(minutes, [s["num_fds"] for s in samples])
    axes[0][1].set(title="worker open file descriptors", xlabel="minutes", ylabel="fds")
    axes[1][0].plot(minutes, [s["kv_blocks_used"] or 0 for s in samples], label="KV blocks used")
    axes[1][0].plot(minutes, [s["num_in_flight"] for s in samples], label="requests in flight")
    axes[1][0].set(title="engine load", xlabel="minutes")
    axes[1][0].legend()
    w_min = [(w["start_s"] + doc["window_s"] / 2) / 60 for w in windows]
    for key, label in (("ttft_p50_ms", "TTFT p50"), ("ttft_p99_ms", "TTFT p99"),
                       ("e2e_p50_ms", "end-to-end p50"), ("e2e_p99_ms", "end-to-end p99")):  # fmt: skip
        axes[1][1].plot(w_min, [w[key] for w in windows], marker="o", label=label)
    axes[1][1].set(title=f"latency per {doc['window_s']:g} s window", xlabel="minutes", ylabel="ms")
    axes[1][1].set_yscale("log")
    axes[1][1].legend(fontsize=8)
    fig.suptitle(f"soak: {doc['model']} {doc['dtype']}, {doc['rate_per_s']} req/s, "
                 f"{doc['minutes']} min, verdict {'ok' if doc['verdict']['ok'] else 'NOT ok'}")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def print_table(doc: dict) -> None:
    v = doc["verdict"]
    rows = [
        ("requests", f"{doc['num_requests']} {doc['finish_reasons']}", ""),
        ("RSS slope (2nd half)", f"{v['rss_slope_mib_per_min']} MiB/min of {v['rss_mean_mib']} MiB",
         "flat" if v["rss_flat"] else "GROWING"),
        ("fd slope (2nd half)", f"{v['fd_slope_per_min']} /min", "flat" if v["fds_flat"] else "GROWING"),
        ("KV blocks in use, idle", str(v["leaked_kv_blocks"]),
         "none leaked" if v["no_leaked_blocks"] else "LEAKED"),
        ("TTFT p99 first -> last", f"{v['ttft_p99_first_window_ms']} -> "
         f"{v['ttft_p99_last_window_ms']} ms (x{v['ttft_p99_last_over_first']})",
         "stable" if v["p99_stable"] else "UNSTABLE"),
    ]  # fmt: skip
    for name, value, word in rows:
        print(f"{name:<24} {value:<60} {word}")
    print(f"verdict: {'ok' if v['ok'] else 'NOT ok'}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--model", default="smollm2-135m", help="a model name or checkpoint path")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rate", type=float, default=1.0, help="requests per second (Poisson)")
    parser.add_argument("--min-tokens", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--cancel-fraction", type=float, default=0.1)
    parser.add_argument("--deadline-fraction", type=float, default=0.1)
    parser.add_argument("--request-timeout-s", type=float, default=120.0)
    parser.add_argument("--sample-s", type=float, default=5.0)
    parser.add_argument("--window-s", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--lazy-pool", action="store_true",
        help="commit the KV pool as blocks are first used (RSS then climbs by up to the pool)",
    )  # fmt: skip
    parser.add_argument(
        "--out", type=Path, help="JSON path (default: loadtest/results/soak-*.json)"
    )
    parser.add_argument("--plot", type=Path, help="PNG path (default: next to the JSON)")
    parser.add_argument("--rescore", type=Path, help="recompute the verdict and PNG of a JSON")


def main(args: argparse.Namespace) -> int:
    if args.rescore:
        doc = json.loads(args.rescore.read_text())
        samples = [Sample(**s) for s in doc["samples"]]
        leaked = doc["verdict"]["leaked_kv_blocks"]
        doc["verdict"] = verdict(samples, doc["windows"], leaked, doc["minutes"] * 60)
        args.out = args.rescore
    else:
        doc = asyncio.run(run(args))
        doc["window_s"] = args.window_s
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = args.out or RESULTS / f"soak-{stamp}.json"
    plot_path = args.plot or out.with_suffix(".png")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2))
    plot(doc, plot_path)
    print_table(doc)
    print(f"wrote {out} and {plot_path}")
    return 0 if doc["verdict"]["ok"] else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="mini-infer soak", description=__doc__.split("\n")[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
