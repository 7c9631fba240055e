"""Kafka security options (SASL and TLS), shared by the worker, `generate` and `loadtest`.

One place turns the settings a deployment writes (`MINI_INFER_KAFKA__SECURITY_PROTOCOL`,
`..._SASL_MECHANISM`, ...) into aiokafka's keyword arguments, so the worker and every command a
producer runs connect the same way. OAUTHBEARER takes its token from a file read at each
(re)connection: a Kubernetes projected service-account token, or a file a sidecar refreshes,
rotates without a restart. Client-side only: aiokafka and the standard library.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from aiokafka.abc import AbstractTokenProvider

SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER")
ENV_PREFIX = "MINI_INFER_KAFKA__"
# flag -> the KafkaSettings field (and MINI_INFER_KAFKA__<FIELD> variable) it stands for.
SECURITY_FLAGS = {
    "--security-protocol": "security_protocol",
    "--sasl-mechanism": "sasl_mechanism",
    "--sasl-username": "sasl_username",
    "--sasl-password-file": "sasl_password",
    "--sasl-oauth-token-file": "sasl_oauth_token_file",
    "--ssl-cafile": "ssl_cafile",
    "--ssl-certfile": "ssl_certfile",
    "--ssl-keyfile": "ssl_keyfile",
}


class FileTokenProvider(AbstractTokenProvider):
    """An OAUTHBEARER token read from a file whenever aiokafka asks (at each connection)."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)

    async def token(self) -> str:
        token = self.path.read_text().strip()
        if not token:
            raise ValueError(f"the OAUTHBEARER token file {self.path} is empty")
        return token


def aiokafka_security_options(
    security_protocol: str = "PLAINTEXT",
    sasl_mechanism: str | None = None,
    sasl_username: str | None = None,
    sasl_password: str | None = None,
    sasl_oauth_token_file: Path | str | None = None,
    ssl_cafile: Path | str | None = None,
    ssl_certfile: Path | str | None = None,
    ssl_keyfile: Path | str | None = None,
    ssl_password: str | None = None,
) -> dict[str, Any]:
    """aiokafka's keyword arguments for these settings. Raises ValueError on a combination
    that cannot connect (SASL without its credentials, TLS files without TLS)."""
    check_security(
        security_protocol, sasl_mechanism, sasl_username, sasl_password, sasl_oauth_token_file,
        has_ssl_files=any(p is not None for p in (ssl_cafile, ssl_certfile, ssl_keyfile)),
    )  # fmt: skip
    options: dict[str, Any] = {"security_protocol": security_protocol}
    if sasl_mechanism == "OAUTHBEARER":
        options["sasl_mechanism"] = sasl_mechanism
        options["sasl_oauth_token_provider"] = FileTokenProvider(sasl_oauth_token_file)
    elif sasl_mechanism is not None:
        options["sasl_mechanism"] = sasl_mechanism
        options["sasl_plain_username"] = sasl_username
        options["sasl_plain_password"] = sasl_password
    if security_protocol.endswith("SSL"):
        from aiokafka.helpers import create_ssl_context

        options["ssl_context"] = create_ssl_context(
            cafile=ssl_cafile, certfile=ssl_certfile, keyfile=ssl_keyfile, password=ssl_password
        )
    return options


def check_security(
    security_protocol: str,
    sasl_mechanism: str | None,
    sasl_username: str | None,
    sasl_password: str | None,
    sasl_oauth_token_file: Path | str | None,
    *,
    has_ssl_files: bool,
) -> None:
    if security_protocol not in SECURITY_PROTOCOLS:
        raise ValueError(f"security_protocol must be one of {SECURITY_PROTOCOLS}")
    if sasl_mechanism is not None and sasl_mechanism not in SASL_MECHANISMS:
        raise ValueError(f"sasl_mechanism must be one of {SASL_MECHANISMS}")
    is_sasl = security_protocol.startswith("SASL")
    if is_sasl and sasl_mechanism is None:
        raise ValueError(f"security_protocol {security_protocol} needs sasl_mechanism")
    if not is_sasl and sasl_mechanism is not None:
        raise ValueError(
            "sasl_mechanism is set but security_protocol is not SASL_PLAINTEXT or SASL_SSL"
        )
    if sasl_mechanism == "OAUTHBEARER" and sasl_oauth_token_file is None:
        raise ValueError("sasl_mechanism OAUTHBEARER needs sasl_oauth_token_file")
    if sasl_mechanism not in (None, "OAUTHBEARER") and (not sasl_username or sasl_password is None):
        raise ValueError(
            f"security_protocol {security_protocol} needs sasl_mechanism, sasl_username and "
            "sasl_password"
        )
    if sasl_oauth_token_file is not None and sasl_mechanism != "OAUTHBEARER":
        raise ValueError("sasl_oauth_token_file is set but sasl_mechanism is not OAUTHBEARER")
    if has_ssl_files and not security_protocol.endswith("SSL"):
        raise ValueError("ssl_* files are set but security_protocol is not SSL or SASL_SSL")


# --- the same options as command-line flags (generate, loadtest) ---------------------------


def add_security_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "Kafka security (default: the worker's MINI_INFER_KAFKA__* variables of the same names)"
    )
    group.add_argument("--security-protocol", choices=SECURITY_PROTOCOLS, default=None)
    group.add_argument("--sasl-mechanism", choices=SASL_MECHANISMS, default=None)
    group.add_argument("--sasl-username", default=None)
    group.add_argument(
        "--sasl-password-file", type=Path, default=None,
        help="a file holding the password (never on the command line; or "
        "MINI_INFER_KAFKA__SASL_PASSWORD)",
    )  # fmt: skip
    group.add_argument(
        "--sasl-oauth-token-file", type=Path, default=None,
        help="OAUTHBEARER: a file holding the token, read at each connection",
    )  # fmt: skip
    group.add_argument("--ssl-cafile", type=Path, default=None, help="CA bundle (PEM)")
    group.add_argument("--ssl-certfile", type=Path, default=None, help="client certificate")
    group.add_argument("--ssl-keyfile", type=Path, default=None, help="its private key")


def security_flags_given(args: argparse.Namespace) -> dict[str, Any]:
    """The KafkaSettings fields the security flags set (the password read from its file)."""
    given: dict[str, Any] = {}
    for flag, name in SECURITY_FLAGS.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"), None)
        if value is None:
            continue
        given[name] = value.read_text().strip() if flag == "--sasl-password-file" else value
    return given


def security_from_args(
    args: argparse.Namespace, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """aiokafka options from the flags, falling back on the MINI_INFER_KAFKA__* variables."""
    env = os.environ if env is None else env
    fields = {
        name: env[ENV_PREFIX + name.upper()]
        for name in (*SECURITY_FLAGS.values(), "ssl_password")
        if env.get(ENV_PREFIX + name.upper())
    }
    fields.update(security_flags_given(args))
    return aiokafka_security_options(**fields)
