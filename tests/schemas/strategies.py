"""Hypothesis strategies for every wire message, drawing anywhere in the valid ranges."""

from __future__ import annotations

from hypothesis import strategies as st

from schemas.contract import MAX_DEADLINE_MS, MAX_SEED, MAX_TOKEN_ID, MAX_TOKENS_LIMIT
from schemas.messages import (
    FINISH_REASONS,
    Cancel,
    ChatMessage,
    Choice,
    ErrorInfo,
    FinalReply,
    Request,
    Timing,
    TokenLogprob,
    TokenReply,
    TopLogprob,
    Usage,
)

TOPIC_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-"

ids = st.text(min_size=1, max_size=40)
topics = st.text(alphabet=TOPIC_ALPHABET, min_size=1, max_size=60).filter(
    lambda t: t not in (".", "..")
)
ms = st.floats(min_value=0, max_value=1e9, allow_nan=False, allow_infinity=False)
chat_messages = st.builds(
    ChatMessage,
    role=st.sampled_from(["system", "user", "assistant", "tool"]),
    content=st.text(max_size=50),
)


@st.composite
def requests(draw: st.DrawFn) -> Request:
    is_chat = draw(st.booleans())
    return Request(
        id=draw(ids),
        reply_to=draw(topics),
        prompt=None if is_chat else draw(st.text(min_size=1, max_size=200)),
        messages=draw(st.lists(chat_messages, min_size=1, max_size=5)) if is_chat else None,
        max_tokens=draw(st.integers(1, MAX_TOKENS_LIMIT)),
        temperature=draw(st.floats(0, 100, allow_nan=False)),
        top_p=draw(st.floats(0, 1, exclude_min=True)),
        top_k=draw(st.integers(-1, 1000)),
        seed=draw(st.none() | st.integers(0, MAX_SEED)),
        stop=draw(st.lists(st.text(min_size=1, max_size=10), max_size=16)),
        stop_token_ids=draw(st.lists(st.integers(0, MAX_TOKEN_ID), max_size=8)),
        ignore_eos=draw(st.booleans()),
        stream=draw(st.booleans()),
        deadline_ms=draw(st.none() | st.integers(0, MAX_DEADLINE_MS)),
        model=draw(st.none() | st.text(min_size=1, max_size=30)),
        **draw(v1_2_sampling()),
    )


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3)
    ),
    max_leaves=6,
)
response_formats = st.one_of(
    st.none(),
    st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
    st.builds(
        lambda name, schema: {
            "type": "json_schema",
            "json_schema": {"name": name, "schema": schema},
        },
        st.text("abcXYZ_-09", min_size=1, max_size=10),
        st.dictionaries(st.text(max_size=6), json_values, max_size=4),
    ),
    st.builds(lambda r: {"type": "regex", "regex": r}, st.text(min_size=1, max_size=20)),
    st.builds(
        lambda c: {"type": "choice", "choice": c},
        st.lists(st.text(min_size=1, max_size=10), min_size=1, max_size=5),
    ),
)


def v1_2_sampling() -> st.SearchStrategy[dict]:
    """The fields added in v1.2, anywhere in their valid ranges."""
    penalty = st.floats(-2, 2, allow_nan=False)
    return st.fixed_dictionaries(
        {},
        optional={
            "presence_penalty": penalty,
            "frequency_penalty": penalty,
            "repetition_penalty": st.floats(0, 10, exclude_min=True),
            "min_p": st.floats(0, 1),
            "logit_bias": st.dictionaries(
                st.integers(0, MAX_TOKEN_ID).map(str), st.floats(-100, 100), max_size=5
            ),
            "top_logprobs": st.integers(0, 20),
            "response_format": response_formats,
            "n": st.integers(1, 16),
        },
    )


token_logprobs = st.builds(
    TokenLogprob,
    token_id=st.integers(0, 2**31),
    logprob=st.floats(-1e4, 0),
    top_logprobs=st.lists(
        st.builds(TopLogprob, token_id=st.integers(0, 2**31), logprob=st.floats(-1e4, 0)),
        max_size=3,
    ),
)

token_replies = st.builds(
    TokenReply,
    id=ids,
    attempt=st.text(min_size=1, max_size=20),
    seq=st.integers(0, 2**32),
    text=st.text(max_size=30),
    token_ids=st.lists(st.integers(0, 2**31), max_size=8),
    index=st.none() | st.integers(0, 15),
    nonce=st.none() | st.text(min_size=1, max_size=20),
    logprobs=st.none() | st.lists(token_logprobs, max_size=3),
)


choices = st.builds(
    Choice,
    index=st.integers(0, 15),
    text=st.text(max_size=30),
    finish_reason=st.sampled_from(FINISH_REASONS),
    completion_tokens=st.integers(0, 10**6),
)


@st.composite
def final_replies(draw: st.DrawFn) -> FinalReply:
    reason = draw(st.sampled_from(FINISH_REASONS))
    error = None
    if reason == "error":
        error = ErrorInfo(
            code=draw(st.text(min_size=1, max_size=20)), message=draw(st.text(max_size=50))
        )
    return FinalReply(
        id=draw(ids),
        attempt=draw(st.text(min_size=1, max_size=20)),
        seq=draw(st.integers(0, 2**32)),
        finish_reason=reason,
        text=draw(st.text(max_size=100)),
        usage=Usage(
            prompt_tokens=draw(st.integers(0, 10**6)), completion_tokens=draw(st.integers(0, 10**6))
        ),
        timing=Timing(queued_ms=draw(ms), ttft_ms=draw(st.none() | ms), total_ms=draw(ms)),
        error=error,
        choices=draw(st.none() | st.lists(choices, min_size=1, max_size=16)),
    )


cancels = st.builds(Cancel, id=ids)
