"""Summaries and output shared by the benchmarks: percentiles, a run's summary, JSON + plot."""

from __future__ import annotations

import json
import statistics
from pathlib import Path


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q) - 1]


def summarize(num_tokens: int, elapsed_s: float, ttfts_s: list[float]) -> dict:
    return {
        "output_tokens": num_tokens,
        "elapsed_s": round(elapsed_s, 3),
        "tokens_per_s": round(num_tokens / elapsed_s, 1),
        "ttft_p50_ms": round(percentile(ttfts_s, 50) * 1000, 1),
        "ttft_p99_ms": round(percentile(ttfts_s, 99) * 1000, 1),
        "ttfts_ms": [round(t * 1000, 1) for t in sorted(ttfts_s)],
    }


def emit(doc: dict, out: Path | None, plot: Path | None, draw) -> None:
    """Print the JSON document, and write it and its plot where asked."""
    print(json.dumps(doc, indent=2))
    if out:
        out.write_text(json.dumps(doc, indent=2))
    if plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig = draw(plt)
        fig.tight_layout()
        fig.savefig(plot, dpi=100)
