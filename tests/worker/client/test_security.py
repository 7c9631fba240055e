"""Kafka security options: any combination either builds aiokafka's options or fails with a
ValueError naming what is missing, never another exception (a typo in a Secret must read as a
configuration error, not a traceback)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from worker.client.security import (
    SASL_MECHANISMS,
    SECURITY_PROTOCOLS,
    FileTokenProvider,
    aiokafka_security_options,
)

maybe_text = st.none() | st.text(max_size=8)


@given(
    protocol=st.sampled_from(SECURITY_PROTOCOLS) | st.text(max_size=12),
    mechanism=st.none() | st.sampled_from(SASL_MECHANISMS) | st.text(max_size=12),
    username=maybe_text,
    password=maybe_text,
    token_file=st.none() | st.just("/run/secrets/token"),
)
def test_any_combination_builds_options_or_names_the_problem(
    protocol, mechanism, username, password, token_file
) -> None:
    try:
        options = aiokafka_security_options(
            protocol, mechanism, username, password, token_file,
            ssl_cafile=None, ssl_certfile=None, ssl_keyfile=None,
        )  # fmt: skip
    except ValueError as error:
        assert str(error)
        return
    assert options["security_protocol"] == protocol
    if mechanism == "OAUTHBEARER":
        assert isinstance(options["sasl_oauth_token_provider"], FileTokenProvider)
    elif mechanism is not None:
        assert options["sasl_plain_username"] == username and username
    assert ("ssl_context" in options) == protocol.endswith("SSL")
