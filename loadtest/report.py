"""Summaries and output shared by the benchmarks: percentiles, a run's summary, JSON + plot."""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
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


def gap_after_first_ms(elapsed_s: float, ttft_ms: float, num_tokens: int) -> float:
    """One stream's mean gap between its tokens after the first, in ms: the time after its
    first token over the gaps (at least one)."""
    return (elapsed_s * 1000 - ttft_ms) / max(num_tokens - 1, 1)


def decode_speed(result: dict) -> float | None:
    """One request's tokens a second after its first: llama-server's own decode speed where it
    reported one (`server_tok_s`), else 1 / `gap_after_first_ms` (a summary of one request);
    None for several requests or too few tokens."""
    own = (result.get("server_tok_s") or {}).get("median")
    if own:
        return own
    ttfts, n = result.get("ttfts_ms") or [], result.get("output_tokens", 0)
    if len(ttfts) != 1 or n < 2 or result["elapsed_s"] * 1000 <= ttfts[0]:
        return None
    return round(1000 / gap_after_first_ms(result["elapsed_s"], ttfts[0], n), 1)


# A token that reaches the reader within this of the one before came with it (one delta, one
# fetch, one burst of a lagging event loop): a reader sees the two at once.
BUNCHED_GAP_S = 0.0005


def token_gaps(arrivals: list[list[float]]) -> dict:
    """The gaps between consecutive tokens of each stream as its reader got them (`arrivals`:
    per stream, one time in seconds per token, in order), pooled over the streams: percentiles,
    the largest, and the share of tokens that came bunched with the one before. The mean gap
    (what an inter-token latency from elapsed time measures) hides bunching: tokens that
    arrive in bursts and tokens that arrive one by one at the same rate have the same mean.
    `cdf_ms`: the gap at every percentile 0..100, for a plot."""
    gaps = sorted(b - a for times in arrivals for a, b in zip(times, times[1:], strict=False))
    if not gaps:
        return {}

    def at(q: float) -> float:  # nearest rank
        return gaps[min(len(gaps) - 1, round(q / 100 * (len(gaps) - 1)))]

    return {
        "num_gaps": len(gaps),
        "mean_ms": round(statistics.fmean(gaps) * 1000, 3),
        "p50_ms": round(at(50) * 1000, 3),
        "p90_ms": round(at(90) * 1000, 3),
        "p99_ms": round(at(99) * 1000, 3),
        "max_ms": round(gaps[-1] * 1000, 3),
        "bunched_share": round(sum(g < BUNCHED_GAP_S for g in gaps) / len(gaps), 3),
        "cdf_ms": [round(at(q) * 1000, 3) for q in range(101)],
    }


def code_under_test(package: str = "worker") -> dict:
    """Which checkout a result measured: the directory `package` is imported from (a script run
    from elsewhere, or against another checkout, need not import the checkout it was started
    in: Python puts the script's own directory first on the path, not the working directory),
    that checkout's commit, and whether its tracked files had uncommitted changes (then the
    commit alone does not reproduce the result). None where git cannot tell."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        return {"tree": None, "commit": None, "dirty": None}
    tree = Path(spec.origin).resolve().parent.parent

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "-C", str(tree), *args], capture_output=True, text=True, timeout=30
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"tree": str(tree), "commit": commit, "dirty": None if status is None else bool(status)}


def emit(doc: dict, out: Path | None, plot: Path | None, draw) -> None:
    """Print the JSON document (with the code it measured, `code_under_test`), and write it and
    its plot where asked."""
    doc = {**doc, "code": doc.get("code") or code_under_test()}
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
