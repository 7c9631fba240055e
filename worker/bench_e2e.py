"""End-to-end benchmark: workload W2 through Kafka versus the engine called directly, same run.

W2: 32 distinct chat prompts submitted together, 128 new tokens each, greedy, EOS ignored.
- direct: `LLMEngine` in this process, TTFT measured from submission to the first delta;
- e2e: embedded broker + one `mini-infer serve` worker process + the client SDK in this
  process; TTFT from `send` to the first streamed token on the reply topic.
The two runs never overlap (each owns both cores while it runs). Targets from the issue:
e2e throughput >= 90% of direct, TTFT overhead p50 <= 20 ms.

    mini-infer bench e2e [--dtype float32] [--max-tokens 128] [--out r.json] [--plot r.png]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from engine.bench import (
    ENGINE_OPTIONS,
    chat_messages,
    chat_prompts,
    emit,
    percentile,
    run_engine,
    summarize,
)


def run_direct(model: str, dtype: str, n: int, max_tokens: int, engine_options: dict) -> dict:
    from engine.loader import load_tokenizer

    prompts = chat_prompts(load_tokenizer(Path(model)), n)
    return run_engine(model, dtype, prompts, max_tokens, **engine_options)


async def run_e2e(bootstrap: str, n: int, max_tokens: int) -> dict:
    from worker.client import MiniInferClient

    async with MiniInferClient(bootstrap) as client:
        # Warm-up: waits for the worker to join its group and for the model to be loaded.
        await client.generate(messages=chat_messages(0), max_tokens=4, temperature=0.0, timeout_s=600)

        async def one(i: int) -> tuple[float, int, float | None]:
            sent = time.perf_counter()
            ttft, num_tokens, worker_ttft_s = None, 0, None
            async for delta in client.stream(
                messages=chat_messages(i), max_tokens=max_tokens, temperature=0.0,
                ignore_eos=True, timeout_s=600,
            ):
                if ttft is None and delta.token_ids:
                    ttft = time.perf_counter() - sent
                num_tokens += len(delta.token_ids)
                if delta.final is not None and delta.final.timing.ttft_ms is not None:
                    worker_ttft_s = delta.final.timing.ttft_ms / 1000
            return ttft, num_tokens, worker_ttft_s

        start = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(n)))
        elapsed = time.perf_counter() - start
    stats = summarize(sum(k for _, k, _ in results), elapsed, [t for t, _, _ in results])
    # The worker's own TTFT (from receiving the message to its first token): the rest of the
    # client's TTFT is transport (produce, fetch waits, publish).
    worker_ttfts = [w for _, _, w in results if w is not None]
    if worker_ttfts:
        stats["worker_ttft_p50_ms"] = round(percentile(worker_ttfts, 50) * 1000, 1)
    return stats


def start_worker(
    bootstrap: str, model: str, dtype: str, ready_file: Path, engine_options: dict
) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "worker.cli", "serve", "--bootstrap-servers", bootstrap,
           "--model", model, "--dtype", dtype, "--log-level", "warning",
           "--ready-file", str(ready_file)]  # fmt: skip
    options = {**ENGINE_OPTIONS, **engine_options}
    engine_env = {f"MINI_INFER_ENGINE__{k.upper()}": str(v) for k, v in options.items()}
    return subprocess.Popen(cmd, env={**os.environ, **engine_env, "PYTHONUNBUFFERED": "1"})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument(
        "--num-threads", type=int, default=None,
        help="torch threads of the engine, both runs (default: torch's, one per core); fewer "
        "than the cores leaves the broker, client and worker I/O a core of their own",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None, help="TTFT distribution plot (PNG)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mini-infer bench e2e", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    from engine.loader import resolve_model
    from worker.broker import EmbeddedBroker

    model = str(resolve_model(args.model))
    print("[bench] direct engine ...", file=sys.stderr, flush=True)
    engine_options = {} if args.num_threads is None else {"num_threads": args.num_threads}
    direct = run_direct(model, args.dtype, args.num_requests, args.max_tokens, engine_options)
    print("[bench] through Kafka ...", file=sys.stderr, flush=True)
    with EmbeddedBroker() as broker, tempfile.TemporaryDirectory() as tmp:
        worker = start_worker(
            broker.bootstrap_servers, model, args.dtype, Path(tmp) / "ready", engine_options
        )
        try:
            e2e = asyncio.run(run_e2e(broker.bootstrap_servers, args.num_requests, args.max_tokens))
        finally:
            worker.send_signal(signal.SIGTERM)
            worker.wait(timeout=60)
    doc = {
        "workload": f"W2: {args.num_requests} chat prompts x {args.max_tokens} tokens, greedy, EOS ignored",
        "dtype": args.dtype,
        "engine_threads": args.num_threads or "torch default",
        "cpu_count": os.cpu_count(),
        "direct": direct,
        "e2e": e2e,
        "throughput_ratio_e2e_over_direct": round(e2e["tokens_per_s"] / direct["tokens_per_s"], 3),
        "ttft_overhead_p50_ms": round(e2e["ttft_p50_ms"] - direct["ttft_p50_ms"], 1),
        "ttft_overhead_p99_ms": round(e2e["ttft_p99_ms"] - direct["ttft_p99_ms"], 1),
    }
    if "worker_ttft_p50_ms" in e2e:
        # Kafka's share of the overhead: from the worker's first token to the client's, plus
        # the request's way in. The rest is the worker's own prefill against the direct one's
        # (two separate runs, whose prefill times differ by tens of ms on a shared CPU).
        doc["ttft_transport_p50_ms"] = round(e2e["ttft_p50_ms"] - e2e["worker_ttft_p50_ms"], 1)
    print(f"{'run':8} {'tok/s':>8} {'ttft p50':>10} {'ttft p99':>10}")
    for name in ("direct", "e2e"):
        r = doc[name]
        print(f"{name:8} {r['tokens_per_s']:8.1f} {r['ttft_p50_ms']:8.1f}ms {r['ttft_p99_ms']:8.1f}ms")
    print(f"e2e/direct throughput: {doc['throughput_ratio_e2e_over_direct']:.3f}; "
          f"TTFT overhead p50 {doc['ttft_overhead_p50_ms']} ms, p99 {doc['ttft_overhead_p99_ms']} ms"
          f" (transport p50 {doc.get('ttft_transport_p50_ms', 'n/a')} ms)")
    emit(doc, args.out, args.plot, lambda plt: _draw(doc, plt))
    return 0


def _draw(doc: dict, plt):
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in ("direct", "e2e"):
        xs = doc[name]["ttfts_ms"]
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name)
    ax.set_xlabel("time to first token (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT CDF, {doc['workload']}")
    ax.legend()
    return fig


if __name__ == "__main__":
    sys.exit(main())
