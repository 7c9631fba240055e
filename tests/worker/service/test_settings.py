"""Settings: env with nesting, CLI overrides, and invalid combinations failing at start-up."""

from __future__ import annotations

import argparse

import pytest
from pydantic import ValidationError

from schemas.headers import Urgency
from worker.cli.serve import add_arguments
from worker.service.settings import WorkerSettings, settings_from_args


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_defaults_need_no_configuration() -> None:
    s = WorkerSettings()
    assert s.model == "smollm2-135m" and s.kafka.is_embedded
    assert s.kafka.request_topic == "mini-infer.requests" and s.kafka.dlq_topic == "mini-infer.dlq"
    assert not s.kafka.use_idempotence  # embedded broker: off
    assert s.batcher.window_ms(Urgency.CRITICAL) == 0 < s.batcher.window_ms(Urgency.LOW)


def test_env_nesting_and_flags_override_env(monkeypatch) -> None:
    monkeypatch.setenv("MINI_INFER_KAFKA__BOOTSTRAP_SERVERS", "kafka:9092")
    monkeypatch.setenv("MINI_INFER_KAFKA__GROUP_ID", "from-env")
    monkeypatch.setenv("MINI_INFER_ENGINE__MAX_NUM_SEQS", "7")
    monkeypatch.setenv("MINI_INFER_MODEL", "/models/x")
    s = settings_from_args(parse("--group-id", "from-flag", "--grace-s", "3"))
    assert s.kafka.bootstrap_servers == "kafka:9092" and s.kafka.group_id == "from-flag"
    assert s.engine.max_num_seqs == 7 and s.model == "/models/x" and s.shutdown_grace_s == 3
    assert s.kafka.use_idempotence  # external Kafka: on by default


def test_secrets_are_not_printed(monkeypatch) -> None:
    s = WorkerSettings(
        kafka={
            "bootstrap_servers": "k:9093",
            "security_protocol": "SASL_SSL",
            "sasl_mechanism": "SCRAM-SHA-512",
            "sasl_username": "u",
            "sasl_password": "hunter2",
        }
    )
    assert "hunter2" not in repr(s)
    assert s.kafka.client_options()["sasl_plain_password"] == "hunter2"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"kafka": {"enable_idempotence": True}}, "embedded broker"),
        (
            {"kafka": {"bootstrap_servers": "k:1", "security_protocol": "SASL_SSL"}},
            "needs sasl_mechanism",
        ),
        ({"kafka": {"sasl_mechanism": "PLAIN"}}, "not SASL"),
        ({"kafka": {"reply_topic_prefix": "mini-infer."}}, "covers"),
        ({"kafka": {"dlq_topic": "mini-infer.requests"}}, "three different"),
        ({"kafka": {"request_timeout_ms": 5000}}, "request_timeout_ms"),
        ({"kafka": {"bootstrap_servers": "k:1", "embedded_port": 9092}}, "embedded_port"),
        ({"kafka": {"bootstrap_servers": "k:1", "embedded_broker": True}}, "choose one"),
        ({"engine": {"block_size": 0}}, "block_size"),
        ({"limits": {"max_num_inflight": 0}}, "max_num_inflight"),
        ({"kafka": {"request_topic": "bad/name"}}, "request_topic"),
        # Settings that were accepted and could not work:
        ({"kafka": {"request_topic": "."}}, "'.' or '..'"),
        ({"kafka": {"reply_topic_prefix": "_"}}, "covers"),
        ({"kafka": {"reply_topic_prefix": "__c"}}, "covers"),
        ({"kafka": {"max_poll_interval_ms": 1}}, "max_poll_interval_ms"),
        (
            {"engine": {"enable_chunked_prefill": False, "max_num_batched_tokens": 64,
                        "max_model_len": 128}},
            "never be scheduled",
        ),
    ],
)
def test_invalid_combinations_fail_with_a_clear_message(overrides, message) -> None:
    with pytest.raises(ValidationError, match=message):
        WorkerSettings(**overrides)
