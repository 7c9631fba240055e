"""`mini-infer generate`: output, exit codes, no torch; in-process with a fake client, and once
for real as a subprocess against the embedded broker and a scripted fake worker."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from schemas.messages import Choice, ErrorInfo, FinalReply, Timing, Usage
from tests.worker.client.client_fixtures import (  # noqa: F401 (the *_fixture names are fixtures)
    final_of,
    serve_fixture,
    tokens_of,
    topics_fixture,
)
from worker import cli
from worker.broker import find_free_port
from worker.cli import generate as generate_cli
from worker.client import MiniInferClient, RequestFailedError, RequestTimeoutError
from worker.client.assembler import Delta


def final(text: str, reason: str = "stop", error: ErrorInfo | None = None) -> FinalReply:
    return FinalReply(
        id="r",
        attempt="w:0",
        seq=2,
        finish_reason=reason,
        text=text,
        usage=Usage(prompt_tokens=4, completion_tokens=2),
        timing=Timing(queued_ms=1.0, ttft_ms=None if reason == "expired" else 12.0, total_ms=30.0),
        error=error,
    )


class FakeClient:
    """Stands in for MiniInferClient: validates like it, replays scripted deltas or raises."""

    instances: list[FakeClient] = []
    script: list[Delta | BaseException] = []

    def __init__(self, bootstrap_servers: str, options=None) -> None:
        self.bootstrap_servers = bootstrap_servers
        self.options = options
        self.stream_options: dict | None = None
        self.is_entered = False
        self.build_request = MiniInferClient(bootstrap_servers, options).build_request
        FakeClient.instances.append(self)

    async def __aenter__(self) -> FakeClient:
        self.is_entered = True
        return self

    async def __aexit__(self, *exc_info) -> None:
        pass

    async def stream(self, **options):
        self.stream_options = options
        for item in FakeClient.script:
            if isinstance(item, BaseException):
                raise item
            yield item


@pytest.fixture(autouse=True)
def fake_client(monkeypatch):
    monkeypatch.setattr("worker.service.log_config.configure_logging", lambda **_: None)
    monkeypatch.setattr(generate_cli, "MiniInferClient", FakeClient)
    monkeypatch.delenv("MINI_INFER_KAFKA__BOOTSTRAP_SERVERS", raising=False)
    FakeClient.instances = []
    FakeClient.script = []


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(["generate", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_streams_text_and_reports_usage(capsys) -> None:
    FakeClient.script = [Delta("Hel"), Delta("lo"), Delta("", final=final("Hello"))]
    code, out, err = run_cli(
        capsys, "Hi", "--raw", "--max-tokens", "8", "--stop", "a", "--stop", "b"
    )
    assert (code, out) == (0, "Hello\n")
    assert "finish_reason=stop" in err and "prompt_tokens=4" in err and "completion_tokens=2" in err
    client = FakeClient.instances[0]
    assert client.bootstrap_servers == "127.0.0.1:9092"
    options = client.stream_options
    assert (
        options["prompt"] == "Hi" and options["max_tokens"] == 8 and options["stop"] == ["a", "b"]
    )
    assert options["urgency"] == "normal" and "stream" not in options and "messages" not in options


def test_n_prints_each_choice_whole(capsys) -> None:
    choices = [Choice(index=0, text="Hi there", finish_reason="stop"),
               Choice(index=1, text="Hello", finish_reason="length")]  # fmt: skip
    with_choices = final("Hi there").model_copy(update={"choices": choices})
    FakeClient.script = [Delta("Hi there"), Delta("Hello", index=1, final=with_choices)]
    code, out, err = run_cli(capsys, "Hi", "--n", "2", "--seed", "3")
    assert (code, out) == (0, "[choice 0]\nHi there\n[choice 1]\nHello\n")
    options = FakeClient.instances[0].stream_options
    assert options["n"] == 2 and options["seed"] == 3 and options["stream"] is False


def test_restart_is_announced_on_stderr(capsys) -> None:
    FakeClient.script = [
        Delta("The cat"),
        Delta("The dog", is_restart=True),
        Delta("", final=final("The dog")),
    ]
    code, out, err = run_cli(capsys, "Hi")
    assert code == 0 and out == "The catThe dog\n" and "diverged" in err


def test_chat_by_default_no_stream_urgency_and_env(capsys, monkeypatch) -> None:
    monkeypatch.setenv("MINI_INFER_KAFKA__BOOTSTRAP_SERVERS", "kafka:9093")
    FakeClient.script = [Delta("Hello", final=final("Hello"))]
    code, out, _ = run_cli(capsys, "Hi", "--no-stream", "--urgency", "critical")
    assert (code, out) == (0, "Hello\n")
    client = FakeClient.instances[0]
    assert client.bootstrap_servers == "kafka:9093"
    options = client.stream_options
    assert options["messages"] == [{"role": "user", "content": "Hi"}] and "prompt" not in options
    assert options["stream"] is False and options["urgency"] == "critical"


@pytest.mark.parametrize(
    ("script", "code", "message"),
    [
        ([RequestFailedError("model_not_served", "no such model")], 1, "model_not_served"),
        ([Delta("par"), RequestTimeoutError("late")], 3, "no answer within"),
        ([Delta("", final=final("", "expired"))], 1, "finish_reason=expired"),
        ([Delta("x", final=final("x", "length"))], 0, "finish_reason=length"),
    ],
)
def test_exit_codes(capsys, script, code: int, message: str) -> None:
    FakeClient.script = script
    actual_code, _, err = run_cli(capsys, "Hi")
    assert actual_code == code and message in err


@pytest.mark.parametrize(
    "argv",
    [
        ["Hi", "--max-tokens", "0"],
        ["Hi", "--top-p", "2"],
        ["Hi", "--stop", ""],
        ["Hi", "--n", "17"],
    ],
)
def test_invalid_arguments_fail_before_connecting(capsys, argv) -> None:
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and out == "" and "invalid request" in err
    assert not any(c.is_entered for c in FakeClient.instances)


def test_unreachable_kafka_is_a_clear_error(capsys, monkeypatch) -> None:
    monkeypatch.setattr(generate_cli, "MiniInferClient", MiniInferClient)
    port = find_free_port()  # nothing listens there
    code, out, err = run_cli(capsys, "Hi", "--bootstrap-servers", f"127.0.0.1:{port}")
    assert code == 4 and out == "" and "cannot reach Kafka" in err


def test_generate_path_does_not_import_torch() -> None:
    code = (
        "import sys; from worker import cli; from worker.cli import generate; "
        "assert 'torch' not in sys.modules and 'engine' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.getcwd())


@pytest.mark.kafka
@pytest.mark.timeout(60)
async def test_real_command_against_the_embedded_broker(broker, topics, serve) -> None:
    await serve(lambda r: [*tokens_of(r, "w:0", ["4", "2"]), final_of(r, "w:0", 2, "42")])
    env = {
        **os.environ,
        "MINI_INFER_KAFKA__BOOTSTRAP_SERVERS": broker.bootstrap_servers,
        "MINI_INFER_KAFKA__REQUEST_TOPIC": topics["request_topic"],
        "MINI_INFER_KAFKA__CONTROL_TOPIC": topics["control_topic"],
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "worker.cli", "generate", "6 x 7?", "--timeout-s", "30",
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), 50)
    assert process.returncode == 0, err.decode()
    assert out.decode() == "42\n"
    assert "finish_reason=stop" in err.decode()


def test_bad_reply_prefix_setting_is_an_invalid_request(capsys, monkeypatch) -> None:
    monkeypatch.setenv("MINI_INFER_KAFKA__REPLY_TOPIC_PREFIX", "no/slashes.")
    code, _, err = run_cli(capsys, "Hi")
    assert code == 2 and "reply_prefix" in err


def test_sasl_options_reach_the_client_from_flags_and_env(capsys, monkeypatch, tmp_path) -> None:
    """The worker's MINI_INFER_KAFKA__* security settings are the defaults; flags override."""
    monkeypatch.setenv("MINI_INFER_KAFKA__SECURITY_PROTOCOL", "SASL_PLAINTEXT")
    monkeypatch.setenv("MINI_INFER_KAFKA__SASL_MECHANISM", "SCRAM-SHA-512")
    monkeypatch.setenv("MINI_INFER_KAFKA__SASL_USERNAME", "from-env")
    password = tmp_path / "password"
    password.write_text("s3cret\n")
    FakeClient.script = [Delta("ok", final=final("ok"))]
    code, _, err = run_cli(capsys, "Hi", "--sasl-password-file", str(password))
    assert code == 0, err
    kafka = FakeClient.instances[0].options.kafka
    assert kafka["security_protocol"] == "SASL_PLAINTEXT"
    assert kafka["sasl_mechanism"] == "SCRAM-SHA-512"
    assert kafka["sasl_plain_username"] == "from-env" and kafka["sasl_plain_password"] == "s3cret"


async def test_oauthbearer_reads_its_token_file_at_each_connection(tmp_path) -> None:
    token = tmp_path / "token"
    token.write_text("first\n")
    argv = ["--security-protocol", "SASL_SSL", "--sasl-mechanism", "OAUTHBEARER",
            "--sasl-oauth-token-file", str(token)]  # fmt: skip
    args = generate_cli_args("Hi", *argv)
    from worker.client.security import security_from_args

    provider = security_from_args(args, env={})["sasl_oauth_token_provider"]
    assert await provider.token() == "first"
    token.write_text("rotated")
    assert await provider.token() == "rotated"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--security-protocol", "SASL_SSL"], "needs sasl_mechanism"),
        (["--security-protocol", "SASL_SSL", "--sasl-mechanism", "OAUTHBEARER"], "token_file"),
        (["--security-protocol", "SASL_SSL", "--sasl-mechanism", "PLAIN"], "sasl_username"),
        (["--sasl-mechanism", "PLAIN"], "not SASL"),
        (["--ssl-cafile", "/ca.pem"], "not SSL"),
        (["--sasl-password-file", "/no/such/file"], "No such file"),
    ],
)
def test_bad_security_options_fail_before_connecting(capsys, argv, message: str) -> None:
    code, out, err = run_cli(capsys, "Hi", *argv)
    assert code == 2 and out == "" and "invalid Kafka security options" in err and message in err
    assert not FakeClient.instances


def generate_cli_args(*argv: str):
    import argparse

    parser = argparse.ArgumentParser()
    generate_cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_loadtest_takes_the_same_security_flags(tmp_path, monkeypatch) -> None:
    import argparse

    from loadtest import loadgen
    from loadtest.loadgen_service import kafka_settings

    for name in list(os.environ):
        if name.startswith("MINI_INFER_"):
            monkeypatch.delenv(name)
    token = tmp_path / "token"
    token.write_text("t")
    parser = argparse.ArgumentParser()
    loadgen.add_arguments(parser)
    args = parser.parse_args([
        "--bootstrap-servers", "kafka:9093", "--security-protocol", "SASL_SSL",
        "--sasl-mechanism", "OAUTHBEARER", "--sasl-oauth-token-file", str(token),
        "--ssl-cafile", str(tmp_path / "ca.pem"),
    ])  # fmt: skip
    kafka = kafka_settings(args, args.bootstrap_servers)
    assert kafka.security_protocol == "SASL_SSL" and kafka.sasl_mechanism == "OAUTHBEARER"
    assert kafka.sasl_oauth_token_file == token and kafka.ssl_cafile == tmp_path / "ca.pem"
