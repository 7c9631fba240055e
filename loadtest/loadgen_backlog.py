"""The backlog scenario of `mini-infer loadtest --backlog N`: a standing backlog of bulk requests
in Kafka, then the measured stream (`--urgency-mix`, e.g. `critical:1`) on its arrival schedule.

It asks the question urgency lanes answer: does urgent work wait behind a backlog? The backlog
(`--backlog-urgency`, low by default) is produced first, all at once; `--backlog-lead-s` later
the measured requests start. By default the run ends when the measured requests are answered:
the backlog requests still unanswered are cancelled, and their TTFT is censored at that moment
(they waited at least that long), so the backlog's TTFT percentiles are lower bounds, marked so.
`--backlog-wait` waits for the whole backlog instead (exact percentiles; the small scenario);
`--backlog-hold-s S` lets it run S seconds longer before censoring (tighter lower bounds).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math

from loadtest.loadgen_stats import RequestResult

CENSORED = "censored: unanswered when the measured requests were done"


@dataclasses.dataclass
class BacklogRun:
    measured: list[RequestResult]
    backlog: list[RequestResult]
    measured_sent_s: list[float]  # seconds since the first backlog send
    backlog_sent_s: list[float]
    censored_ttft_s: list[float | None]  # per backlog request: TTFT, or its lower bound
    stop_s: float
    duration_s: float


def backlog_args(args: argparse.Namespace) -> argparse.Namespace:
    """The workload arguments of the backlog: same lengths, its own urgency and seed."""
    return argparse.Namespace(
        **{**vars(args), "num_prompts": args.backlog, "cancel_fraction": 0.0,
           "urgency_mix": f"{args.backlog_urgency}:1", "seed": args.seed + 1},
    )  # fmt: skip


async def run_backlog(
    client,
    backlog_specs,
    specs,
    options,
    offsets_s: list[float],
    lead_s: float,
    is_waiting: bool,
    hold_s: float = 0.0,
) -> BacklogRun:
    from loadtest.loadgen import run_one

    loop = asyncio.get_running_loop()
    start_s = loop.time()

    async def sent_now(spec, sent: list[float]) -> RequestResult:
        sent.append(loop.time() - start_s)
        return await run_one(client, spec, options)

    backlog_sent: list[float] = []
    backlog_tasks = [asyncio.create_task(sent_now(s, backlog_sent)) for s in backlog_specs]
    await asyncio.sleep(lead_s)
    measured_start_s = loop.time()
    measured_sent: list[float] = []
    tasks = []
    for spec, offset_s in zip(specs, offsets_s, strict=True):
        await asyncio.sleep(max(0.0, measured_start_s + offset_s - loop.time()))
        tasks.append(asyncio.create_task(sent_now(spec, measured_sent)))
    measured = list(await asyncio.gather(*tasks))
    if is_waiting:
        await asyncio.gather(*backlog_tasks)
    elif hold_s > 0:  # the backlog runs on: its censored TTFTs come closer to the truth
        await asyncio.wait(backlog_tasks, timeout=hold_s)
    stop_s = loop.time() - start_s
    for task in backlog_tasks:
        task.cancel()  # leaving a stream cancels its request on the worker
    outcomes = await asyncio.gather(*backlog_tasks, return_exceptions=True)
    backlog, censored = [], []
    for spec, outcome, sent_s in zip(backlog_specs, outcomes, backlog_sent, strict=False):
        result = outcome if isinstance(outcome, RequestResult) else None
        if result is None or result.ttft_s is None:
            result = result or RequestResult(urgency=spec.urgency, error=CENSORED)
            censored.append(stop_s - sent_s)
        else:
            censored.append(result.ttft_s)
        backlog.append(result)
    return BacklogRun(
        measured, backlog, measured_sent, backlog_sent, censored, stop_s, loop.time() - start_s
    )


def summarize_backlog(run: BacklogRun, measured_p50_ttft_ms: float | None) -> dict:
    """The backlog's TTFT p50 (a lower bound when any request was censored) and the measured
    requests' p50 as a ratio of it."""
    values = sorted(v for v in run.censored_ttft_s if v is not None)
    num_answered = sum(1 for r in run.backlog if r.ttft_s is not None)
    p50_ms = _median(values) * 1000 if values else None
    is_censored = num_answered < len(run.backlog)
    ratio = None
    if p50_ms and measured_p50_ttft_ms is not None:
        ratio = measured_p50_ttft_ms / p50_ms
    return {
        "num_backlog": len(run.backlog),
        "num_backlog_first_token": num_answered,
        "backlog_median_ttft_ms": p50_ms,
        "backlog_ttft_is_lower_bound": is_censored,
        "measured_over_backlog_ttft_p50": ratio,  # an upper bound when censored
        "stop_s": run.stop_s,
    }


def _median(values: list[float]) -> float:
    n = len(values)
    mid = n // 2
    return values[mid] if n % 2 else (values[mid - 1] + values[mid]) / 2


def format_backlog(summary: dict) -> str:
    p50 = summary["backlog_median_ttft_ms"]
    bound = ">= " if summary["backlog_ttft_is_lower_bound"] else ""
    ratio = summary["measured_over_backlog_ttft_p50"]
    ratio_text = "-" if ratio is None else f"{'<= ' if bound else ''}{ratio:.3f}"
    p50_text = "-" if p50 is None or math.isnan(p50) else f"{bound}{p50:.1f}"
    text = (
        f"backlog: {summary['num_backlog_first_token']}/{summary['num_backlog']} got a first "
        f"token; TTFT p50 {p50_text} ms; measured p50 / backlog p50: {ratio_text}"
    )
    split = summary.get("ttft_split")
    if split and split["num_requests"]:
        text += (
            f"; answered ones' TTFT parts p50 (ms): worker {split['median_worker_ttft_ms']:.1f},"
            f" in {split['median_kafka_in_ms']:.1f}, out {split['median_reply_out_ms']:.1f}"
        )
    return text
