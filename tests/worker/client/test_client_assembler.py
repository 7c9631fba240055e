"""ReplyAssembler: the client rule under redelivery, duplicates, divergence and reordering."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.messages import (
    Choice,
    FinalReply,
    Timing,
    TokenLogprob,
    TokenReply,
    TopLogprob,
    Usage,
)
from worker.client.assembler import Delta, ReplyAssembler

PIECES = ["a", "b", "ab", "", " ", "é", "🚀"]


def token(attempt: str, seq: int, text: str) -> TokenReply:
    return TokenReply(id="r", attempt=attempt, seq=seq, text=text, token_ids=[seq, len(text)])


def final(attempt: str, seq: int, text: str, reason: str = "stop") -> FinalReply:
    return FinalReply(
        id="r",
        attempt=attempt,
        seq=seq,
        finish_reason=reason,
        text=text,
        usage=Usage(prompt_tokens=3, completion_tokens=seq),
        timing=Timing(queued_ms=1.0, ttft_ms=2.0, total_ms=3.0),
    )


def publish(attempt: str, texts: list[str], is_finished: bool) -> list[TokenReply | FinalReply]:
    """What one attempt writes: its token messages, then a final when it finished."""
    messages: list[TokenReply | FinalReply] = [token(attempt, i, t) for i, t in enumerate(texts)]
    if is_finished:
        messages.append(final(attempt, len(texts), "".join(texts)))
    return messages


def apply(deltas: list[Delta], text: str = "") -> str:
    for delta in deltas:
        text = delta.text if delta.is_restart else text + delta.text
    return text


def feed_all(replies) -> tuple[ReplyAssembler, list[Delta]]:
    assembler = ReplyAssembler()
    deltas = [d for reply in replies for d in assembler.feed(reply)]
    return assembler, deltas


def test_single_attempt_streams_in_order() -> None:
    assembler, deltas = feed_all(publish("w1:0", ["Hel", "lo", "!"], True))
    assert [d.text for d in deltas] == ["Hel", "lo", "!", ""]
    assert deltas[0].token_ids == [0, 3]
    assert deltas[-1].final is not None and assembler.is_done
    assert not any(d.is_restart for d in deltas)


def test_identical_retry_is_deduplicated() -> None:
    first = publish("w1:0", ["A", "B"], False)
    second = publish("w2:0", ["A", "B", "C"], True)
    assembler, deltas = feed_all(first + second)
    assert [d.text for d in deltas] == ["A", "B", "C", ""]
    assert assembler.num_dropped == 2 and assembler.num_restarts == 0


def test_diverging_retry_restarts_with_replacement_text() -> None:
    first = publish("w1:0", ["A", "B", "C"], False)
    second = publish("w2:0", ["A", "X", "Y"], True)
    _, deltas = feed_all(first + second)
    restart = next(d for d in deltas if d.is_restart)
    assert restart.text == "AX" and restart.token_ids == [0, 1, 1, 1]
    assert apply(deltas) == "AXY"


def test_old_attempt_is_ignored_after_divergence_but_not_its_final() -> None:
    assembler = ReplyAssembler()
    assembler.feed(token("old", 0, "A"))
    assembler.feed(token("new", 0, "Z"))  # diverged: follow "new"
    assert assembler.feed(token("old", 1, "B")) == []
    [delta] = assembler.feed(final("old", 2, "AB"))  # the first final wins, whoever sent it
    assert delta.is_restart and delta.text == "AB" and delta.final.attempt == "old"
    assert assembler.feed(final("new", 1, "Z")) == []


def test_gap_waits_for_the_missing_message() -> None:
    assembler = ReplyAssembler()
    assert assembler.feed(token("w", 1, "B")) == []
    assert [d.text for d in assembler.feed(token("w", 0, "A"))] == ["A", "B"]


def test_final_fills_in_what_was_lost() -> None:
    _, deltas = feed_all([token("w", 0, "A"), final("w", 3, "ABC")])
    assert [d.text for d in deltas] == ["A", "BC"] and deltas[-1].token_ids == []


def test_error_final_is_passed_on() -> None:
    error = FinalReply.model_validate(
        {
            **final("w", 0, "").model_dump(),
            "finish_reason": "error",
            "error": {"code": "x", "message": "m"},
        }
    )
    [delta] = ReplyAssembler().feed(error)
    assert delta.final.error.code == "x"


@st.composite
def redelivery_runs(draw: st.DrawFn) -> list[TokenReply | FinalReply]:
    """1-3 attempts of one request: each regenerates a shared prefix, maybe diverges, maybe dies
    partway, and their messages interleave arbitrarily with redelivered duplicates."""
    base = draw(st.lists(st.sampled_from(PIECES), min_size=1, max_size=8))
    streams = []
    num_attempts = draw(st.sampled_from([1, 2, 2, 3, 3]))
    for n in range(num_attempts):
        is_last = n == num_attempts - 1
        cut = draw(st.integers(0, len(base)))
        tail = draw(st.lists(st.sampled_from(PIECES), max_size=4))
        texts = base if draw(st.booleans()) else base[:cut] + tail
        # The last attempt usually completes; earlier ones usually die partway.
        if is_last and draw(st.integers(0, 3)) > 0:
            num_published = len(texts)
        else:
            num_published = draw(st.integers(0, len(texts)))
        is_finished = num_published == len(texts) and (is_last or draw(st.booleans()))
        streams.append(publish(f"w{n}:0", texts[:num_published], is_finished))
    merged: list[TokenReply | FinalReply] = []
    while any(streams):
        live = [s for s in streams if s]
        merged.append(live[draw(st.integers(0, len(live) - 1))].pop(0))
        if draw(st.integers(0, 4)) == 0:  # a producer retry: an earlier message again, later
            merged.append(merged[draw(st.integers(0, len(merged) - 1))])
    return merged


@settings(max_examples=400, deadline=None)
@given(replies=redelivery_runs())
def test_user_sees_exactly_the_winning_final(replies) -> None:
    assembler, deltas = feed_all(replies)
    finals = [r for r in replies if isinstance(r, FinalReply)]
    assert apply(deltas) == assembler.shown_text or assembler.is_done
    if finals:
        assert assembler.final == finals[0]
        assert apply(deltas) == finals[0].text
        assert [d.final for d in deltas if d.final is not None] == [finals[0]]
        assert deltas[-1].final is finals[0]
    else:
        assert not assembler.is_done and all(d.final is None for d in deltas)


@settings(max_examples=200, deadline=None)
@given(replies=redelivery_runs())
def test_mid_stream_text_is_one_attempts_prefix(replies) -> None:
    """Before the final, the user never sees a mix of two attempts."""
    by_attempt: dict[str, dict[int, str]] = {}
    for r in replies:
        if isinstance(r, TokenReply):
            by_attempt.setdefault(r.attempt, {})[r.seq] = r.text
    prefixes = {
        "".join(texts[seq] for seq in range(n))
        for texts in by_attempt.values()
        for n in range(len(texts) + 1)
    }
    assembler = ReplyAssembler()
    text = ""
    for reply in replies:
        text = apply(assembler.feed(reply), text)
        if assembler.is_done:
            break
        assert text == assembler.shown_text
        assert text in prefixes or text == ""


@settings(max_examples=200, deadline=None)
@given(texts=st.lists(st.sampled_from(PIECES), max_size=8), data=st.data())
def test_identical_attempts_never_restart(texts: list[str], data) -> None:
    num_dead = data.draw(st.integers(0, len(texts)))
    replies = publish("w1:0", texts[:num_dead], False) + publish("w2:0", texts, True)
    assembler, deltas = feed_all(replies)
    assert not any(d.is_restart for d in deltas)
    assert [d.text for d in deltas[:-1]] == texts


def with_logprobs(reply: TokenReply, base: float) -> TokenReply:
    entries = [
        TokenLogprob(
            token_id=t, logprob=-base - i, top_logprobs=[TopLogprob(token_id=t, logprob=-base)]
        )
        for i, t in enumerate(reply.token_ids)
    ]
    return reply.model_copy(update={"logprobs": entries})


def test_deltas_carry_logprobs_and_a_restart_carries_the_new_attempts() -> None:
    died = [with_logprobs(token("a:0", i, t), 1.0) for i, t in enumerate(["The ", "cat"])]
    retry = [with_logprobs(token("b:0", i, t), 2.0) for i, t in enumerate(["The ", "dog"])]
    _, deltas = feed_all([*died, *retry])
    assert [d.logprobs for d in deltas[:2]] == [m.logprobs for m in died]
    restart = deltas[-1]
    assert restart.is_restart and restart.token_ids == [t for m in retry for t in m.token_ids]
    assert restart.logprobs == [e for m in retry for e in m.logprobs]
    _, plain = feed_all(publish("a:0", ["x", "y"], True))
    assert all(d.logprobs is None for d in plain)


def test_choices_assemble_by_index_and_a_diverging_retry_restarts_each() -> None:
    """v1.2 n=2: deltas carry the choice; applying each choice's deltas gives its final text."""

    def msg(attempt: str, seq: int, index: int, text: str) -> TokenReply:
        return TokenReply(id="r", attempt=attempt, seq=seq, text=text, index=index)

    choices = [Choice(index=0, text="AB", finish_reason="stop"),
               Choice(index=1, text="xZ", finish_reason="length")]  # fmt: skip
    done = final("new", 4, "AB").model_copy(update={"choices": choices})
    replies = [
        msg("old", 0, 0, "A"), msg("old", 1, 1, "x"), msg("old", 2, 1, "y"),
        msg("new", 0, 0, "A"), msg("new", 1, 1, "x"), msg("new", 2, 1, "Z"),
        msg("new", 3, 0, "B"), done,
    ]  # fmt: skip
    assembler, deltas = feed_all(replies)
    assert assembler.num_restarts == 1
    restarts = [d for d in deltas if d.is_restart]
    assert [(d.index, d.text) for d in restarts] == [(0, "A"), (1, "xZ")]
    for choice in choices:
        assert apply([d for d in deltas if d.index == choice.index]) == choice.text
    assert deltas[-1].final is done and sum(d.final is not None for d in deltas) == 1
