"""Settings: env with nesting, CLI overrides, and invalid combinations failing at start-up."""

from __future__ import annotations

import argparse

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from schemas.headers import Urgency
from worker.cli.serve import add_arguments
from worker.service.settings import WorkerSettings, parse_byte_size, settings_from_args


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


def test_oauthbearer_takes_its_token_from_a_file(tmp_path) -> None:
    token = tmp_path / "token"
    s = WorkerSettings(
        kafka={
            "bootstrap_servers": "k:9093",
            "security_protocol": "SASL_PLAINTEXT",
            "sasl_mechanism": "OAUTHBEARER",
            "sasl_oauth_token_file": token,
        }
    )
    options = s.kafka.client_options()
    assert options["sasl_mechanism"] == "OAUTHBEARER"
    assert options["sasl_oauth_token_provider"].path == token
    assert "sasl_plain_username" not in options


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
        (
            {"kafka": {"bootstrap_servers": "k:1", "security_protocol": "SASL_SSL",
                       "sasl_mechanism": "OAUTHBEARER"}},
            "sasl_oauth_token_file",
        ),
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


def test_engine_size_flags_and_the_embedded_broker_switch(monkeypatch) -> None:
    for name in ("MINI_INFER_KAFKA__BOOTSTRAP_SERVERS", "MINI_INFER_KAFKA__EMBEDDED_BROKER"):
        monkeypatch.delenv(name, raising=False)
    s = settings_from_args(
        parse("--max-model-len", "2048", "--max-num-seqs", "16", "--kv-cache-memory", "1.5GiB")
    )
    assert s.engine.max_model_len == 2048 and s.engine.max_num_seqs == 16
    assert s.engine.kv_cache_memory_bytes == 3 << 29
    assert not s.kafka.embedded_broker  # absent switch: env/default
    assert settings_from_args(parse("--embedded-broker")).kafka.embedded_broker


@pytest.mark.parametrize(
    ("text", "size"),
    [("536870912", 512 << 20), ("512MiB", 512 << 20), ("512mi", 512 << 20), ("2G", 2 * 10**9),
     ("64 KiB", 64 << 10), ("1b", 1)],
)  # fmt: skip
def test_byte_sizes(text: str, size: int) -> None:
    assert parse_byte_size(text) == size


@given(st.text(max_size=12))
def test_any_size_text_parses_or_fails_as_an_argument_error(text: str) -> None:
    try:
        assert parse_byte_size(text) >= 1
    except argparse.ArgumentTypeError as error:
        assert repr(text) in str(error)


def test_serve_version_flag(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse("--version")
    assert exit_info.value.code == 0 and capsys.readouterr().out.startswith("mini-infer ")
