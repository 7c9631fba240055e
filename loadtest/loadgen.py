"""`mini-infer loadtest`: a load generator that reports like `vllm bench serve`.

It talks to the service only through Kafka and the documented contract, with the client SDK:
requests go to the request topic with an urgency header, replies stream back on the client's
reply topic. With no `--bootstrap-servers` it starts an embedded broker and one
`mini-infer serve` worker first, so it runs anywhere at once:

    mini-infer loadtest --num-prompts 16 --request-rate 2 --output-len 32
    mini-infer loadtest --sweep 1,2,4,8 --goodput ttft:500 tpot:100 --plot-dir plots/
    mini-infer loadtest --bootstrap-servers kafka:9092 --max-concurrency 8 --out r.json
    mini-infer loadtest --backlog 2000 --num-prompts 3 --urgency-mix critical:1 --request-rate 1

Requests go to their urgency lane (`request_topic_for`, contract v1.2) unless the workers run
without lanes (MINI_INFER_KAFKA__URGENCY_LANES=false). `--backlog N` is the backlog scenario
(`loadtest.loadgen_backlog`): N low requests produced first, then the measured ones.

Arrivals are open-loop as in vLLM (the first request at 0, then gamma-distributed gaps of mean
`1 / --request-rate` and shape `--burstiness`; 1 = Poisson), optionally capped by
`--max-concurrency` in-flight requests (with the default infinite rate: a closed loop). Prompts
are random words, `--input-len` of them (about one token each; the reported token counts are the
worker's own, from each final's usage), and every request asks for exactly its output length
(`ignore_eos`). The arithmetic lives in `loadtest.loadgen_stats`, the plots in
`loadtest.loadgen_plots`, the broker and worker it starts in `loadtest.loadgen_service`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from loadtest.loadgen_backlog import backlog_args, format_backlog, run_backlog, summarize_backlog
from loadtest.loadgen_service import READY_TIMEOUT_S, embedded_service, kafka_settings, make_client
from loadtest.loadgen_stats import (
    URGENCIES,
    RequestResult,
    arrival_gaps_s,
    arrival_offsets_s,
    assign_urgencies,
    parse_goodput,
    parse_urgency_mix,
    sample_lengths,
    summarize_run,
    ttft_split_ms,
)
from loadtest.workloads import chat_messages
from worker.client.security import add_security_arguments

# Common short English words: with a leading space, each is one token of a GPT-2-style BPE.
_WORDS_TEXT = (
    "the of and to in is was for on are with as his they be at one have this from or had by "
    "word but what some we can out other were all there when up use your how said an each she "
    "which do their time if will way about many then them write would like so these her long "
    "make thing see him two has look more day could go come did number sound no most people my "
    "over know water than call first who may down side been now find any new work part take "
    "get place made live where after back little only round man year came show every good me "
    "give our under name very through just form great think say help low line differ turn cause"
)
WORDS = tuple(_WORDS_TEXT.split())


@dataclass(frozen=True)
class RequestSpec:
    """One request of the workload, drawn before the run so every rate of a sweep sends the
    same requests. `cancel_after_tokens`: stop reading (and cancel) after that many tokens."""

    prompt: str | None
    messages: list[dict] | None
    target_prompt_len: int
    max_tokens: int
    urgency: str
    cancel_after_tokens: int | None = None


@dataclass(frozen=True)
class RunOptions:
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    deadline_ms: int | None = None
    timeout_s: float = 600.0
    seed: int = 0
    show_progress: bool = True


def build_workload(args: argparse.Namespace) -> list[RequestSpec]:
    rng = random.Random(args.seed)
    n = args.num_prompts
    input_lens = sample_lengths(n, args.input_len, args.range_ratio, rng)
    output_lens = sample_lengths(n, args.output_len, args.range_ratio, rng)
    urgencies = assign_urgencies(n, parse_urgency_mix(args.urgency_mix), rng)
    cancelled = set(rng.sample(range(n), round(n * args.cancel_fraction)))
    specs = []
    for i in range(n):
        if args.dataset == "chat":
            prompt, messages = None, chat_messages(i)
        else:
            prompt, messages = " ".join(rng.choices(WORDS, k=input_lens[i])), None
        cancel_after = max(1, output_lens[i] // 2) if i in cancelled else None
        specs.append(
            RequestSpec(prompt, messages, input_lens[i], output_lens[i], urgencies[i], cancel_after)
        )
    return specs


async def run_one(client, spec: RequestSpec, options: RunOptions) -> RequestResult:
    from worker.client import ClientError, RequestFailedError

    result = RequestResult(urgency=spec.urgency, prompt_len=spec.target_prompt_len)
    deadline_ms = None
    if options.deadline_ms is not None:
        deadline_ms = int(time.time() * 1000) + options.deadline_ms
    sent_s = time.perf_counter()
    stream = client.stream(
        spec.prompt,
        messages=spec.messages,
        urgency=spec.urgency,
        timeout_s=options.timeout_s,
        max_tokens=spec.max_tokens,
        ignore_eos=True,
        temperature=0.0,
        deadline_ms=deadline_ms,
    )
    try:
        async with contextlib.aclosing(stream):
            async for delta in stream:
                now_s = time.perf_counter() - sent_s
                if delta.token_ids:
                    result.chunk_times_s.append(now_s)
                    result.output_len += len(delta.token_ids)
                if delta.final is not None:
                    _take_final(result, delta.final, now_s)
                elif (
                    spec.cancel_after_tokens is not None
                    and result.output_len >= spec.cancel_after_tokens
                ):
                    result.finish_reason = "cancelled"  # leaving the stream sends the cancel
                    result.e2el_s = now_s
                    break
    except RequestFailedError as error:
        if error.final is not None:
            _take_final(result, error.final, time.perf_counter() - sent_s)
        result.error = str(error)
    except (ClientError, TimeoutError) as error:
        result.error = repr(error)
    return result


def _take_final(result: RequestResult, final, elapsed_s: float) -> None:
    result.finish_reason = final.finish_reason
    result.e2el_s = elapsed_s
    result.prompt_len = final.usage.prompt_tokens
    result.output_len = final.usage.completion_tokens
    result.worker_timing = final.timing.model_dump(exclude_none=True)


async def run_load(
    client, specs: list[RequestSpec], options: RunOptions
) -> tuple[list[RequestResult], float]:
    """Send `specs` on the arrival schedule; returns the results (in spec order) and the run's
    duration, from the first send to the last answer."""
    from tqdm import tqdm

    gaps = arrival_gaps_s(len(specs), options.request_rate, options.burstiness, options.seed)
    offsets = arrival_offsets_s(gaps)
    limit = asyncio.Semaphore(options.max_concurrency or len(specs) or 1)
    progress = tqdm(total=len(specs), disable=not options.show_progress, unit="req")

    async def limited(spec: RequestSpec) -> RequestResult:
        async with limit:
            result = await run_one(client, spec, options)
        progress.update(1)
        return result

    loop = asyncio.get_running_loop()
    start_s = loop.time()
    tasks = []
    for spec, offset_s in zip(specs, offsets, strict=True):
        await asyncio.sleep(max(0.0, start_s + offset_s - loop.time()))
        tasks.append(asyncio.create_task(limited(spec)))
    results = await asyncio.gather(*tasks)
    duration_s = loop.time() - start_s
    progress.close()
    return list(results), duration_s


# --- the command ------------------------------------------------------------------------------


def _rates(text: str) -> list[float]:
    rates = [float(x) for x in text.split(",") if x.strip()]
    if not rates or any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"want positive rates like 1,2,4 (inf allowed): {text!r}")
    return rates


def add_arguments(parser: argparse.ArgumentParser) -> None:
    service = parser.add_argument_group("service (default: an embedded broker and worker)")
    service.add_argument("--bootstrap-servers", default=None, help="load this Kafka's workers")
    service.add_argument("--request-topic", default=None)
    service.add_argument("--control-topic", default=None)
    add_security_arguments(parser)
    service.add_argument("--model", default="smollm2-135m", help="embedded worker's model")
    service.add_argument("--dtype", default="float32", help="embedded worker's dtype")
    service.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="embedded worker's torch threads (default: cores - 1)",
    )
    load = parser.add_argument_group("load (as vllm bench serve)")
    load.add_argument("--num-prompts", type=int, default=16)
    load.add_argument(
        "--request-rate", type=float, default=math.inf, help="requests/s (inf: all at once)"
    )
    load.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 = Poisson"
    )
    load.add_argument("--max-concurrency", type=int, default=None, help="cap on in-flight requests")
    load.add_argument(
        "--sweep", type=_rates, default=None, help="run at each of these rates, e.g. 1,2,4"
    )
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--dataset", choices=("random", "chat"), default="random",
                      help="random: words of --input-len; chat: the W2 chat prompts")  # fmt: skip
    load.add_argument("--input-len", type=int, default=64)
    load.add_argument("--output-len", type=int, default=32)
    load.add_argument("--range-ratio", type=float, default=0.0, help="0: fixed lengths")
    load.add_argument(
        "--urgency-mix", default="normal:1", help="e.g. critical:0.1,normal:0.6,low:0.3"
    )
    load.add_argument(
        "--deadline-ms", type=int, default=None, help="each request's deadline, from its send"
    )
    load.add_argument(
        "--cancel-fraction", type=float, default=0.0, help="cancel this share halfway"
    )
    load.add_argument("--timeout-s", type=float, default=600.0, help="per request")
    backlog = parser.add_argument_group("backlog scenario (loadtest/loadgen_backlog.py)")
    backlog.add_argument("--backlog", type=int, default=0,
                         help="produce this many requests first, a standing backlog")  # fmt: skip
    backlog.add_argument("--backlog-urgency", default="low", choices=URGENCIES)
    backlog.add_argument("--backlog-lead-s", type=float, default=3.0,
                         help="after the backlog is sent, before the measured requests")  # fmt: skip
    backlog.add_argument("--backlog-wait", action="store_true",
                         help="wait for the whole backlog (default: censor it at the end)")  # fmt: skip
    backlog.add_argument("--backlog-hold-s", type=float, default=0.0,
                         help="after the measured requests, let the backlog run this long")  # fmt: skip
    report = parser.add_argument_group("report")
    report.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                        help="SLOs for goodput: ttft:MS tpot:MS e2el:MS")  # fmt: skip
    report.add_argument("--percentiles", default="50,90,99", help="e.g. 50,90,99,99.9")
    report.add_argument("--out", type=Path, default=None, help="write the JSON here")
    report.add_argument("--plot-dir", type=Path, default=None, help="write PNG plots here")
    report.add_argument("--no-progress", action="store_true")


def _check(args: argparse.Namespace) -> tuple[dict[str, float] | None, list[float]]:
    """Raise ValueError on bad input before anything starts."""
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    if not 0 <= args.cancel_fraction <= 1:
        raise ValueError("--cancel-fraction must be in [0, 1]")
    if args.backlog < 0 or args.backlog_lead_s < 0 or args.backlog_hold_s < 0:
        raise ValueError("--backlog, --backlog-lead-s and --backlog-hold-s must be >= 0")
    if args.deadline_ms is not None and args.deadline_ms < 0:
        raise ValueError("--deadline-ms must be >= 0")
    percentiles = [float(p) for p in args.percentiles.split(",")]
    if any(not 0 <= p <= 100 for p in percentiles):
        raise ValueError("--percentiles must be in [0, 100]")
    if args.plot_dir is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--plot-dir needs matplotlib (the dev extras)") from None
    build_workload(args)  # lengths, ratio and urgency mix
    arrival_gaps_s(1, args.request_rate, args.burstiness, args.seed)
    return (parse_goodput(args.goodput) if args.goodput else None), percentiles


async def run_command(args: argparse.Namespace, bootstrap_servers: str) -> dict:
    """Warm up, then one run per rate; returns the JSON document."""
    slos, percentiles = _check(args)
    kafka = kafka_settings(args, bootstrap_servers)
    rates = args.sweep or [args.request_rate]
    runs, samples = [], []
    async with make_client(kafka) as client:
        # Not counted: waits for the worker's group join and warms its first forward pass.
        await client.generate("warm up", max_tokens=2, timeout_s=READY_TIMEOUT_S)
        for rate in rates:
            options = RunOptions(
                rate, args.burstiness, args.max_concurrency, args.deadline_ms,
                args.timeout_s, args.seed, not args.no_progress,
            )  # fmt: skip
            if args.backlog:
                results, duration_s, backlog_doc = await _run_with_backlog(
                    client, args, options, slos, percentiles
                )
            else:
                results, duration_s = await run_load(client, build_workload(args), options)
                backlog_doc = None
            doc = summarize_run(results, duration_s, slos, percentiles)
            if backlog_doc is not None:
                doc["backlog"] = backlog_doc
            doc.update(_run_header(args, rate, slos))
            doc.update(_samples(results))
            runs.append(doc)
            samples.append(results)
            print(format_table(doc), file=sys.stderr, flush=True)
            if backlog_doc is not None:
                print(format_backlog(backlog_doc), file=sys.stderr, flush=True)
    if args.plot_dir is not None:
        from loadtest.loadgen_plots import write_plots

        write_plots(args.plot_dir, runs, samples)
    return runs[0] if len(runs) == 1 else {"sweep": runs}


async def _run_with_backlog(client, args, options: RunOptions, slos, percentiles):
    """The backlog scenario: returns the measured results, the duration, the backlog summary
    (and its plot, with --plot-dir)."""
    backlog_specs = build_workload(backlog_args(args))
    gaps = arrival_gaps_s(args.num_prompts, options.request_rate, options.burstiness, args.seed)
    run = await run_backlog(
        client, backlog_specs, build_workload(args), options, arrival_offsets_s(gaps),
        args.backlog_lead_s, args.backlog_wait, args.backlog_hold_s,
    )  # fmt: skip
    measured = summarize_run(run.measured, run.duration_s, slos, percentiles)
    backlog_doc = summarize_backlog(run, measured.get("median_ttft_ms"))
    backlog_doc["ttft_split"] = ttft_split_ms(run.backlog, percentiles)
    backlog_doc["backlog_ttfts"] = run.censored_ttft_s
    backlog_doc["backlog_sent_s"] = run.backlog_sent_s
    backlog_doc["measured_sent_s"] = run.measured_sent_s
    if args.plot_dir is not None:
        from loadtest.loadgen_plots import plot_backlog

        args.plot_dir.mkdir(parents=True, exist_ok=True)
        plot_backlog(args.plot_dir / "backlog_ttft.png", run, backlog_doc)
    return run.measured, run.duration_s, backlog_doc


def _run_header(args: argparse.Namespace, rate: float, slos) -> dict:
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S"),
        "model_id": args.model if args.bootstrap_servers is None else None,
        "request_rate": rate if math.isfinite(rate) else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "dataset": args.dataset,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "range_ratio": args.range_ratio,
        "urgency_mix": parse_urgency_mix(args.urgency_mix),
        "deadline_ms": args.deadline_ms,
        "cancel_fraction": args.cancel_fraction,
        "backlog_size": args.backlog,
        "backlog_urgency": args.backlog_urgency,
        "goodput_slos_ms": slos,
        "seed": args.seed,
    }


def _samples(results: list[RequestResult]) -> dict:
    """Per-request arrays, as vLLM's JSON keeps them (`ttfts`, `itls`, ... in seconds)."""
    return {
        "urgencies": [r.urgency for r in results],
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_len for r in results],
        "ttfts": [r.ttft_s for r in results],
        "itls": [r.itls_s for r in results],
        "e2els": [r.e2el_s for r in results],
        "errors": [r.error or "" for r in results],
    }


def format_table(doc: dict) -> str:
    """vLLM's console summary, plus a line per urgency."""
    lines = [f"{' Serving Benchmark Result (rate ' + str(doc['request_rate']) + ') ':=^60}"]
    for label, key in (
        ("Successful requests:", "completed"),
        ("Failed / cancelled requests:", None),
        ("Benchmark duration (s):", "duration"),
        ("Total input tokens:", "total_input_tokens"),
        ("Total generated tokens:", "total_output_tokens"),
        ("Request throughput (req/s):", "request_throughput"),
        ("Request goodput (req/s):", "request_goodput"),
        ("Output token throughput (tok/s):", "output_throughput"),
    ):
        value = f"{doc['failed']} / {doc['cancelled']}" if key is None else doc[key]
        if isinstance(value, float):
            value = f"{value:.2f}"
        lines.append(f"{label:<40}{value if value is not None else '-':>20}")
    header = f"{'urgency':<10}{'n':>4}{'TTFT p50':>10}{'p99':>9}{'TPOT p50':>10}{'ITL p99':>9}{'E2E p99':>9}"
    # The client's TTFT p50 beside its parts (loadgen_stats.ttft_split_ms): the worker's own
    # TTFT, the request's way in, the first token's way out.
    header += f"{'worker':>9}{'in':>8}{'out':>8}"
    lines.append(header + "  (ms)")
    for name, m in [("overall", doc), *doc["per_urgency"].items()]:
        split = m.get("ttft_split") or doc.get("ttft_split") or {}
        lines.append(
            f"{name:<10}{m['completed']:>4}{m['median_ttft_ms']:>10.1f}{m.get('p99_ttft_ms', 0):>9.1f}"
            f"{m['median_tpot_ms']:>10.1f}{m.get('p99_itl_ms', 0):>9.1f}{m.get('p99_e2el_ms', 0):>9.1f}"
            + "".join(f"{split.get(f'median_{p}_ms', 0):>{w}.1f}"
                      for p, w in (("worker_ttft", 9), ("kafka_in", 8), ("reply_out", 8)))
        )  # fmt: skip
    split = doc["latency_split"]
    parts = [p for p in split if p != "num_requests"]
    lines.append(
        "mean split (ms): " + ", ".join(f"{p} {split[p][f'mean_{p}_ms']:.1f}" for p in parts)
    )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    try:
        _check(args)
    except ValueError as error:
        print(f"mini-infer loadtest: {error}", file=sys.stderr)
        return 2

    async def go() -> dict:
        if args.bootstrap_servers is not None:
            return await run_command(args, args.bootstrap_servers)
        from engine.loader import resolve_model

        model = str(resolve_model(args.model))
        async with embedded_service(model, args.dtype, args.num_threads) as bootstrap_servers:
            return await run_command(args, bootstrap_servers)

    doc = asyncio.run(go())
    text = json.dumps(doc, indent=2)
    if args.out is not None:
        args.out.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        prog="mini-infer loadtest", description=__doc__.split("\n\n")[0]
    )
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
