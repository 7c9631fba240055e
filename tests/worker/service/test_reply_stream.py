"""Message boundaries depend only on tokens; deltas concatenate to the final's text."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas.messages import FinalReply, Timing, TokenReply, Usage
from worker.service.reply_stream import ReplyStream

USAGE = Usage(prompt_tokens=3, completion_tokens=0)
TIMING = Timing(queued_ms=0, ttft_ms=None, total_ms=1)

deltas = st.lists(
    st.tuples(st.text(max_size=4), st.lists(st.integers(0, 500), min_size=1, max_size=2)),
    max_size=30,
)


def run(stream: ReplyStream, pieces) -> list[TokenReply | FinalReply]:
    out: list[TokenReply | FinalReply] = []
    for text, token_ids in pieces:
        out += stream.add(text, token_ids)
    return out + stream.finish("length", USAGE, TIMING)


@given(deltas, st.integers(1, 5))
def test_seq_is_contiguous_and_texts_concatenate_to_the_final(pieces, tokens_per_message) -> None:
    messages = run(ReplyStream("r", "w:1", tokens_per_message, True), pieces)
    assert [m.seq for m in messages] == list(range(len(messages)))
    *tokens, final = messages
    assert isinstance(final, FinalReply) and all(isinstance(m, TokenReply) for m in tokens)
    assert "".join(m.text for m in tokens) == final.text == "".join(t for t, _ in pieces)
    assert [i for m in tokens for i in m.token_ids] == [i for _, ids in pieces for i in ids]
    # Every message but the first (out with the first text) and the last (before the final)
    # holds at least tokens_per_message tokens.
    assert all(len(m.token_ids) >= tokens_per_message for m in tokens[1:-1])


@given(deltas, st.integers(2, 6))
def test_the_first_message_goes_out_with_the_first_text(pieces, tokens_per_message) -> None:
    """More tokens a message never delays the first token: the delta that brings the first
    text closes the first message, whatever its size."""
    stream = ReplyStream("r", "w:1", tokens_per_message, True)
    for k, (text, token_ids) in enumerate(pieces):
        out = stream.add(text, token_ids)
        if text:
            assert len(out) == 1 and out[0].seq == 0
            assert out[0].text == text
            assert out[0].token_ids == [i for _, ids in pieces[: k + 1] for i in ids]
            break
        assert out == []


@given(deltas, st.integers(1, 4))
def test_two_attempts_with_the_same_tokens_publish_identical_messages(
    pieces, tokens_per_message
) -> None:
    first = run(ReplyStream("r", "w1:7", tokens_per_message, True), pieces)
    second = run(ReplyStream("r", "w2:1", tokens_per_message, True), pieces)
    strip = [m.model_dump(exclude={"attempt"}) for m in first]
    assert strip == [m.model_dump(exclude={"attempt"}) for m in second]


def test_not_streaming_sends_only_the_final() -> None:
    messages = run(ReplyStream("r", "w:1", 1, False), [("a", [1]), ("b", [2])])
    assert len(messages) == 1 and messages[0].text == "ab" and messages[0].seq == 0


def test_one_final_per_attempt() -> None:
    stream = ReplyStream("r", "w:1", 1, True)
    stream.finish("stop", USAGE, TIMING)
    with pytest.raises(RuntimeError):
        stream.finish("stop", USAGE, TIMING)


choice_deltas = st.lists(
    st.tuples(
        st.integers(0, 2), st.text(max_size=3), st.lists(st.integers(0, 9), min_size=1, max_size=2)
    ),
    max_size=30,
)


@given(choice_deltas, st.integers(1, 3))
def test_choices_stream_by_index_and_the_final_lists_each(pieces, tokens_per_message) -> None:
    """v1.2 n=3: one seq count for the attempt; each choice's messages concatenate to its text."""
    stream = ReplyStream("r", "w:1", tokens_per_message, True, num_choices=3)
    messages = []
    for index, text, token_ids in pieces:
        messages += stream.add(text, token_ids, index=index)
    stream.add("", [], index=1, finish_reason="stop")
    messages += stream.finish("length", USAGE, TIMING)
    assert [m.seq for m in messages] == list(range(len(messages)))
    *tokens, final = messages
    assert [c.index for c in final.choices] == [0, 1, 2]
    assert [c.finish_reason for c in final.choices] == ["length", "stop", "length"]
    for choice in final.choices:
        mine = [m for m in tokens if m.index == choice.index]
        assert "".join(m.text for m in mine) == choice.text
        assert choice.text == "".join(t for i, t, _ in pieces if i == choice.index)
        want_ids = [t for i, _, ids in pieces if i == choice.index for t in ids]
        assert [t for m in mine for t in m.token_ids] == want_ids
        assert choice.completion_tokens == len(want_ids)
    assert final.text == final.choices[0].text
    assert stream.num_output_tokens == sum(len(ids) for _, _, ids in pieces)


def test_n_1_replies_have_no_index_or_choices() -> None:
    """Old clients see exactly what they saw: neither field is on the wire for n=1."""
    from schemas.codec import MSGPACK, encode

    stream = ReplyStream("r", "w:1", 1, True)
    messages = stream.add("a", [1]) + stream.finish("stop", USAGE, TIMING)
    assert all(m.index is None for m in messages[:-1]) and messages[-1].choices is None
    for message in messages:
        dumped = message.model_dump(mode="json", exclude_none=True)
        assert "index" not in dumped and "choices" not in dumped
        assert encode(message, MSGPACK)
