"""PNG plots of `mini-infer loadtest` runs: latency CDFs per urgency (one file per rate), and for
a sweep, throughput, goodput and p99 TTFT against the offered request rate."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from loadtest.loadgen_stats import URGENCIES, RequestResult

METRICS = (("ttft", "time to first token"), ("tpot", "time per output token"),
           ("itl", "inter-token latency"), ("e2el", "end-to-end latency"))  # fmt: skip


def _samples_ms(results: Sequence[RequestResult], metric: str) -> list[float]:
    served = [r for r in results if r.is_served]
    if metric == "itl":
        values = [x for r in served for x in r.itls_s]
    else:
        values = [getattr(r, f"{metric}_s") for r in served]
    return sorted(v * 1000 for v in values if v is not None)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _rate_label(rate) -> str:
    return str(rate) if rate == "inf" else f"{float(rate):g}"


def plot_cdfs(path: Path, doc: dict, results: Sequence[RequestResult]) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    groups = [("overall", list(results))] + [
        (u, [r for r in results if r.urgency == u]) for u in URGENCIES
    ]
    for ax, (metric, title) in zip(axes, METRICS, strict=True):
        for name, group in groups:
            xs = _samples_ms(group, metric)
            if not xs or (name != "overall" and len(groups) == 2):
                continue
            # From (first, 0) so every curve starts on the axis, then up 1/n at each sample.
            n = len(xs)
            xs, ys = [xs[0], *xs], [0.0] + [(i + 1) / n for i in range(n)]
            style = {"color": "black", "linewidth": 2} if name == "overall" else {}
            ax.step(xs, ys, where="post", label=f"{name} ({n})", **style)
        ax.set_xlabel(f"{title} (ms)")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction")
    axes[0].legend(fontsize=8)
    fig.suptitle(
        f"Latency CDFs by urgency: rate {_rate_label(doc['request_rate'])} req/s, "
        f"{doc['num_prompts']} prompts, {doc['input_len']} in / {doc['output_len']} out tokens"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_sweep(path: Path, runs: Sequence[dict]) -> None:
    plt = _pyplot()
    finite = [r for r in runs if r["request_rate"] != "inf"]
    rates = [r["request_rate"] for r in finite]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(rates, [r["request_throughput"] for r in finite], "o-", label="request throughput")
    if finite and finite[0]["request_goodput"] is not None:
        left.plot(rates, [r["request_goodput"] for r in finite], "s--", label="request goodput")
    left.plot(rates, rates, ":", color="grey", label="offered")
    left.set_xlabel("offered request rate (req/s)")
    left.set_ylabel("req/s")
    twin = left.twinx()
    twin.plot(rates, [r["output_throughput"] for r in finite], "^-", color="tab:green")
    twin.set_ylabel("output tokens/s", color="tab:green")
    left.legend(fontsize=8, loc="upper left")
    right.plot(rates, [r["p99_ttft_ms"] for r in finite], "o-", color="black", label="overall")
    for urgency in URGENCIES:
        ys = [r["per_urgency"].get(urgency, {}).get("p99_ttft_ms") for r in finite]
        if all(y is not None for y in ys) and len(finite[0]["per_urgency"]) > 1:
            right.plot(rates, ys, ".--", label=urgency)
    right.set_xlabel("offered request rate (req/s)")
    right.set_ylabel("p99 time to first token (ms)")
    right.set_yscale("log")
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.suptitle("Sweep: throughput, goodput and p99 TTFT against the offered rate")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_plots(
    plot_dir: Path, runs: Sequence[dict], samples: Sequence[Sequence[RequestResult]]
) -> list[Path]:
    plot_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for doc, results in zip(runs, samples, strict=True):
        suffix = "" if len(runs) == 1 else f"_rate_{_rate_label(doc['request_rate'])}"
        paths.append(plot_dir / f"latency_cdf{suffix}.png")
        plot_cdfs(paths[-1], doc, results)
    if len(runs) > 1:
        paths.append(plot_dir / "sweep.png")
        plot_sweep(paths[-1], runs)
    return paths


def plot_backlog(path: Path, run, summary: dict) -> None:
    """The backlog scenario: each request's TTFT against when it was sent, backlog and measured
    requests apart; a backlog request censored at the end (no first token yet) is hollow."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    answered = [(s, t) for s, t, r in zip(run.backlog_sent_s, run.censored_ttft_s, run.backlog,
                                          strict=False) if r.ttft_s is not None]  # fmt: skip
    censored = [(s, t) for s, t, r in zip(run.backlog_sent_s, run.censored_ttft_s, run.backlog,
                                          strict=False) if r.ttft_s is None]  # fmt: skip
    measured = [(s, r.ttft_s) for s, r in zip(run.measured_sent_s, run.measured, strict=False)
                if r.ttft_s is not None]  # fmt: skip
    urgency = run.backlog[0].urgency if run.backlog else "backlog"
    if answered:
        ax.scatter(*zip(*answered, strict=True), s=6, color="tab:blue", label=f"{urgency} backlog")
    if censored:
        ax.scatter(*zip(*censored, strict=True), s=6, facecolors="none", edgecolors="tab:blue",
                   label=f"{urgency}, no first token by the end (TTFT >=)")  # fmt: skip
    if measured:
        label = ", ".join(sorted({r.urgency for r in run.measured}))
        ax.scatter(*zip(*measured, strict=True), s=40, color="tab:red", marker="^", label=label)
    ax.set_yscale("log")
    ax.set_xlabel("sent at (s since the first backlog request)")
    ax.set_ylabel("time to first token (s)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    p50 = summary.get("backlog_median_ttft_ms")
    bound = ">= " if summary.get("backlog_ttft_is_lower_bound") else ""
    ax.set_title(
        f"{summary['num_backlog']} {urgency} requests in Kafka, then the measured stream; "
        f"backlog TTFT p50 {bound}{(p50 or 0) / 1000:.1f} s", fontsize=10,
    )  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
