"""Urgency end to end, with the real model: critical vs low TTFT through Kafka and a worker
started by `mini-infer serve`, with urgency lanes and steps sized by urgency (`new`) against
the same worker without any of them (`baseline`: MINI_INFER_KAFKA__URGENCY_LANES=false,
MINI_INFER_ENGINE__STEP_TIME_TARGET_MS=0, MINI_INFER_ENGINE__MAX_STEP_TIME_MS=0). Each run is
one `mini-infer loadtest --backlog` (its own embedded broker and worker); the sides alternate
for `--rounds` rounds and the medians are compared.

    python -m loadtest.bench_urgency --scenario no-backlog --rounds 2
    python -m loadtest.bench_urgency --scenario backlog --backlog 2000 --rounds 1

Scenarios (issue 19): `no-backlog`: 24 low requests, 3 critical ones a second later, every
answer awaited; `backlog`: N low requests in Kafka, then 3 critical ones; the run ends when the
critical ones are answered (the low ones' TTFT is then censored: a lower bound, marked `>=`).
`w2`: no urgent work at all, W2 (32 chat prompts at once, 128 tokens each) through the worker,
`new` against `nocap` (the step caps off): what the caps cost in output tokens/s.
Requests are 64 prompt words in, `--output-len` (64) tokens out. The machine is shared:
`uptime` is recorded.

    python -m loadtest.bench_urgency --scenario w2 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SIDES = {
    "baseline": {"MINI_INFER_KAFKA__URGENCY_LANES": "false",
                 "MINI_INFER_ENGINE__STEP_TIME_TARGET_MS": "0",
                 "MINI_INFER_ENGINE__MAX_STEP_TIME_MS": "0"},
    "new": {"MINI_INFER_KAFKA__URGENCY_LANES": "true"},
    # The step caps off, lanes as `new`: what the caps cost when nobody urgent waits (`w2`).
    "nocap": {"MINI_INFER_ENGINE__STEP_TIME_TARGET_MS": "0",
              "MINI_INFER_ENGINE__MAX_STEP_TIME_MS": "0"},
}  # fmt: skip


def loadtest_argv(args: argparse.Namespace, out: Path, plot_dir: Path | None) -> list[str]:
    argv = [sys.executable, "-m", "worker.cli", "loadtest", "--no-progress", "--out", str(out),
            "--timeout-s", str(args.timeout_s), "--model", args.model]  # fmt: skip
    if args.scenario == "w2":  # 32 chat prompts at once, 128 tokens each, all normal
        return argv + ["--dataset", "chat", "--num-prompts", "32", "--output-len", "128"]
    argv += ["--num-prompts", "3", "--urgency-mix", "critical:1", "--input-len", "64",
             "--output-len", str(args.output_len)]  # fmt: skip
    if args.scenario == "no-backlog":
        argv += ["--backlog", "24", "--backlog-wait", "--backlog-lead-s", "1"]
    else:
        argv += ["--backlog", str(args.backlog), "--backlog-lead-s", str(args.lead_s),
                 "--backlog-hold-s", str(args.hold_s)]  # fmt: skip
    if plot_dir is not None:
        argv += ["--plot-dir", str(plot_dir)]
    return argv


def run_side(args: argparse.Namespace, side: str, index: int, tmp: Path) -> dict:
    out = tmp / f"{side}-{index}.json"
    plot_dir = args.plot_dir / f"{args.scenario}-{side}-{index}" if args.plot_dir else None
    env = {**os.environ, **SIDES[side]}
    load = _uptime()
    subprocess.run(loadtest_argv(args, out, plot_dir), env=env, check=True, timeout=3600)
    doc = json.loads(out.read_text())
    if args.scenario == "w2":
        return {
            "side": side, "round": index, "uptime": load, "completed": doc["completed"],
            "output_throughput": doc["output_throughput"],
            "median_ttft_ms": doc["median_ttft_ms"], "median_tpot_ms": doc["median_tpot_ms"],
        }  # fmt: skip
    backlog = doc["backlog"]
    critical = doc["per_urgency"].get("critical", {})
    return {
        "side": side,
        "round": index,
        "uptime": load,
        "critical_completed": critical.get("completed", 0),
        "critical_p50_ttft_ms": critical.get("median_ttft_ms"),
        "low_p50_ttft_ms": backlog["backlog_median_ttft_ms"],
        "low_is_lower_bound": backlog["backlog_ttft_is_lower_bound"],
        "critical_over_low": backlog["measured_over_backlog_ttft_p50"],
        # The client's TTFT in parts (loadgen_stats.ttft_split_ms), p50 in ms.
        "critical_ttft_split": _split_p50(critical.get("ttft_split")),
        "low_ttft_split": _split_p50(backlog.get("ttft_split")),
        "errors": [e for e in doc.get("errors", []) if e][:3],
    }


def _split_p50(split: dict | None) -> dict | None:
    if not split or not split["num_requests"]:
        return None
    parts = ("worker_ttft", "kafka_in", "reply_out")
    return {p: round(split[f"median_{p}_ms"], 1) for p in parts}


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "?"


def _median(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r[key] is not None]
    return statistics.median(values) if values else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", choices=("no-backlog", "backlog", "w2"), default="no-backlog")
    parser.add_argument("--output-len", type=int, default=64, help="of every request but w2's")
    parser.add_argument("--backlog", type=int, default=2000)
    parser.add_argument("--lead-s", type=float, default=3.0)
    parser.add_argument("--hold-s", type=float, default=30.0, help="backlog: censor this later")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sides", default=None, help="default: new,baseline (w2: new,nocap)")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--plot-dir", type=Path, default=None)
    args = parser.parse_args()
    sides = (args.sides or ("new,nocap" if args.scenario == "w2" else "new,baseline")).split(",")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(args.rounds):
            order = sides if index % 2 == 0 else sides[::-1]  # alternate who goes first
            for side in order:
                rows.append(run_side(args, side, index, Path(tmp)))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    if args.scenario == "w2":
        print_w2(rows, sides)
        return 0
    print(f"{'side':<10}{'critical p50':>14}{'low p50':>14}{'crit/low':>10}  (ms, medians)")
    summary = {}
    for side in sides:
        mine = [r for r in rows if r["side"] == side]
        crit, low = _median(mine, "critical_p50_ttft_ms"), _median(mine, "low_p50_ttft_ms")
        bound = ">=" if any(r["low_is_lower_bound"] for r in mine) else ""
        ratio = _median(mine, "critical_over_low")
        summary[side] = {"critical_p50_ttft_ms": crit, "low_p50_ttft_ms": low,
                         "low_is_lower_bound": bool(bound), "critical_over_low": ratio}  # fmt: skip
        print(f"{side:<10}{_fmt(crit):>14}{bound + _fmt(low):>14}{_fmt(ratio, 3):>10}")
    print(json.dumps({"scenario": args.scenario, "runs": rows, "summary": summary}, indent=2))
    return 0


def print_w2(rows: list[dict], sides: list[str]) -> None:
    """Output tokens/s per side (medians) and each side's ratio to the first."""
    print(f"{'side':<10}{'out tok/s':>12}{'ratio':>8}{'TTFT p50':>10}{'TPOT p50':>10}  (medians)")
    summary = {}
    for side in sides:
        mine = [r for r in rows if r["side"] == side]
        summary[side] = {k: _median(mine, k) for k in ("output_throughput", "median_ttft_ms",
                                                       "median_tpot_ms")}  # fmt: skip
    first = summary[sides[0]]["output_throughput"]
    for side in sides:
        m = summary[side]
        m["throughput_ratio"] = m["output_throughput"] / first if first else None
        print(f"{side:<10}{_fmt(m['output_throughput'], 2):>12}{_fmt(m['throughput_ratio'], 3):>8}"
              f"{_fmt(m['median_ttft_ms']):>10}{_fmt(m['median_tpot_ms']):>10}")  # fmt: skip
    print(json.dumps({"scenario": "w2", "runs": rows, "summary": summary}, indent=2))


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


if __name__ == "__main__":
    sys.exit(main())
