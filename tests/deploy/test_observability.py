"""The Grafana dashboard and the Prometheus alert rules name only what the worker exports: every
metric and every label in their queries is checked against the Prometheus exposition of a real
`Telemetry` whose instruments have all been used once. A renamed metric or label fails here
instead of leaving an empty panel or an alert that can never fire. The rules also go through
`promtool` when it is installed (Debian's `prometheus` package)."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from prometheus_client import generate_latest

from worker.service.settings import ObservabilitySettings
from worker.service.telemetry import Telemetry, _Bound

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "mini-infer-workers.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yaml"
# Series Prometheus makes itself, and PromQL words that look like names.
PROMETHEUS_OWN = {"up"}
PROMQL_WORDS = {
    "sum", "max", "min", "avg", "by", "without", "rate", "increase", "deriv", "and", "or",
    "unless", "histogram_quantile", "label_values", "le", "bool", "on", "ignoring",
}  # fmt: skip


def exported() -> dict[str, set[str]]:
    """Prometheus series name -> its label names, with every instrument used once."""
    t = Telemetry(ObservabilitySettings(), "w", model_name="m", group_id="g")
    attributes = {
        "urgency": "normal", "stage": "kafka", "finish_reason": "error", "error.type": "x",
        "reason": "r", "gen_ai.operation.name": "chat", "messaging.destination.name": "t",
    }  # fmt: skip
    for value in vars(t).values():
        if isinstance(value, _Bound):
            for method in ("add", "record"):  # a counter has no record, a histogram no add
                with contextlib.suppress(AttributeError):
                    getattr(value, method)(1, attributes)
    stats = SimpleNamespace(
        num_running=1, num_waiting=1, num_blocks_total=8, num_blocks_free=4, num_preemptions=0,
        num_prefix_queries=0, num_prefix_hits=0, num_tokens_computed=0, num_fused_steps=0,
        num_fused_steps_one_thread=0, fused_step_gil_wait_s=0.0, num_draft_tokens=0,
        num_draft_accepted=0,
    )  # fmt: skip
    t.observe_engine(stats)
    t.kafka_state.lags = {("t", 0): 3}
    series: dict[str, set[str]] = {}
    for line in generate_latest(t.prometheus_registry).decode().splitlines():
        if line and not line.startswith("#"):
            name, _, labels = line.split(" ")[0].partition("{")
            series.setdefault(name, set()).update(re.findall(r'(\w+)="', labels))
    t.shutdown()
    return series


SERIES = exported()


def queries() -> list[tuple[str, str]]:
    """(where, PromQL) of every dashboard target, template query and alert rule."""
    dashboard = json.loads(DASHBOARD.read_text())
    found = [
        (f"panel {p['title']!r}", target["expr"])
        for p in dashboard["panels"]
        for target in p["targets"]
    ]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            found.append((f"variable {variable['name']}", variable["definition"]))
    for group in yaml.safe_load(ALERTS.read_text())["groups"]:
        found.extend((f"alert {r['alert']}", r["expr"]) for r in group["rules"])
    return found


def names_in(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, label names) a PromQL expression uses."""
    text = re.sub(r'"[^"]*"', '""', expr)  # string values are not names
    text = re.sub(r"\[[^\]]*\]", "", text)  # nor range durations
    labels = set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", text))
    for grouping in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", text):
        labels.update(n.strip() for n in grouping.split(",") if n.strip())
    for call in re.findall(r"label_values\(\s*\w+\s*,\s*(\w+)\s*\)", text):
        labels.add(call)
    metrics = {
        word
        for word in re.findall(r"\b[a-zA-Z_:][\w:]*\b", re.sub(r"\{[^}]*\}", "", text))
        if word not in PROMQL_WORDS and word not in labels and not word.startswith("__")
        and not re.fullmatch(r"\d+|e\d*", word)
    }  # fmt: skip
    return metrics, labels - {"le", "job", "instance"}


def test_the_exposition_is_what_the_readme_names() -> None:
    assert "mini_infer_prefix_cache_hits_total" in SERIES
    assert "gen_ai_server_time_to_first_token_seconds_bucket" in SERIES
    assert "gen_ai_request_model" in SERIES["mini_infer_kv_cache_usage"]


@pytest.mark.parametrize(("where", "expr"), queries())
def test_every_query_names_exported_metrics_and_labels(where: str, expr: str) -> None:
    metrics, labels = names_in(expr)
    assert metrics, f"{where}: no metric found in {expr!r}"
    for metric in metrics - PROMETHEUS_OWN:
        assert metric in SERIES, f"{where}: the worker exports no {metric}"
        missing = labels - SERIES[metric]
        assert not missing, f"{where}: {metric} has no label {sorted(missing)}"


def test_the_check_catches_a_misspelt_metric_or_label() -> None:
    metrics, labels = names_in("sum by (stage) (rate(mini_infer_request_queue_seconds_bucket[5m]))")
    assert "mini_infer_request_queue_seconds_bucket" in metrics
    assert "mini_infer_request_queue_seconds_bucket" not in SERIES
    metrics, labels = names_in('mini_infer_kv_cache_usage{model_name="x"}')
    assert labels - SERIES["mini_infer_kv_cache_usage"] == {"model_name"}


def test_alert_rules_are_well_formed() -> None:
    for group in yaml.safe_load(ALERTS.read_text())["groups"]:
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}
            assert rule["labels"]["severity"] in ("critical", "warning", "info")
            assert rule["annotations"]["summary"]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_accepts_the_rules() -> None:
    result = subprocess.run(
        ["promtool", "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_readme_metrics_table_names_exported_metrics() -> None:
    """Each name in the table's first column is exported; `_waiting` after a full name means
    that name with its last segment(s) replaced."""
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("| Mini-Infer (Prometheus name)") :].split("\n\n")[0]

    def is_exported(name: str) -> bool:
        return name in SERIES or f"{name}_bucket" in SERIES

    num_checked = 0
    for row in table.splitlines()[2:]:
        names = re.findall(r"`(\w+)`", row.split("|")[1])
        for name in names:
            if name.startswith("_"):
                parts = names[0].split("_")
                candidates = ["_".join(parts[:-n]) + name for n in range(1, len(parts))]
                assert any(map(is_exported, candidates)), f"README names {names[0]} ... {name}"
            else:
                assert is_exported(name), f"README names {name}"
            num_checked += 1
    assert num_checked >= 20
