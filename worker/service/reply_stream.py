"""The replies of one attempt: where token messages start and end, their `seq`, and the final.

Message boundaries depend only on the generated tokens, never on timing: a choice's first
message closes with its first text (more tokens a message never delays the first token), every
later one once it holds `tokens_per_message` tokens and some text (1: every engine text delta),
and whatever is left goes out just before the final. So two attempts that generate the same
tokens publish the same messages with the same `seq`, and a client can tell a duplicate from a
divergence by comparing texts at equal `seq`. Pure: no Kafka, no clock.

A request with n > 1 (contract v1.2) has n choices: each buffers and closes its messages as
above, the messages carry their choice's `index` and share the attempt's one `seq` count (how
choices interleave follows the engine's steps), and the final lists every choice.
"""

from __future__ import annotations

from schemas.messages import (
    Choice,
    ErrorInfo,
    FinalReply,
    Timing,
    TokenLogprob,
    TokenReply,
    Usage,
)


class _ChoiceBuffer:
    """One choice's text so far and its token message being filled."""

    def __init__(self) -> None:
        self.parts: list[str] = []  # every text delta: the choice's text is their concatenation
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] | None = None
        self.num_tokens = 0
        self.num_sent = 0  # token messages taken
        self.finish_reason: str | None = None  # set when the engine finished this choice


class ReplyStream:
    def __init__(
        self,
        request_id: str,
        attempt: str,
        tokens_per_message: int,
        is_streaming: bool,
        nonce: str | None = None,
        num_choices: int = 1,
    ) -> None:
        self.request_id = request_id
        self.nonce = nonce  # the request's, echoed in every reply (contract v1.2)
        self.attempt = attempt
        self.tokens_per_message = tokens_per_message
        self.is_streaming = is_streaming
        self._choices = [_ChoiceBuffer() for _ in range(num_choices)]
        self._next_seq = 0
        self.finish_reason: str | None = None  # set once the final is made

    @property
    def text(self) -> str:
        """Choice 0's text (the only one for n=1)."""
        return "".join(self._choices[0].parts)

    @property
    def num_choices(self) -> int:
        return len(self._choices)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far, over every choice."""
        return sum(c.num_tokens for c in self._choices)

    def choice_finish_reason(self, index: int) -> str | None:
        return self._choices[index].finish_reason

    @property
    def num_messages(self) -> int:
        return self._next_seq

    def add(
        self,
        text: str,
        token_ids: list[int],
        logprobs: list[TokenLogprob] | None = None,
        index: int = 0,
        finish_reason: str | None = None,
    ) -> list[TokenReply]:
        """One engine delta of choice `index` in; the token messages it completes out (none
        when not streaming). `logprobs`, when the request asked for them, has one entry per
        token of `token_ids`; `finish_reason` is set on the choice's last delta."""
        choice = self._choices[index]
        if text:
            choice.parts.append(text)
        choice.num_tokens += len(token_ids)
        if finish_reason is not None:
            choice.finish_reason = finish_reason
        if not self.is_streaming:
            return []
        if text:
            choice.text.append(text)
        choice.token_ids.extend(token_ids)
        if logprobs is not None:
            choice.logprobs = (choice.logprobs or []) + logprobs
        # A choice's first message goes out with its first text, whatever the size: the first
        # token's latency is not traded for fewer messages.
        if choice.text and (
            len(choice.token_ids) >= self.tokens_per_message or choice.num_sent == 0
        ):
            return [self._take(index)]
        return []

    def finish(
        self,
        finish_reason: str,
        usage: Usage,
        timing: Timing,
        error: ErrorInfo | None = None,
    ) -> list[TokenReply | FinalReply]:
        """The last token messages (what is still buffered, by choice) and the final, in that
        order. A choice the engine had not finished ends with `finish_reason`."""
        if self.finish_reason is not None:
            raise RuntimeError(f"attempt {self.attempt} already has its final")
        messages: list[TokenReply | FinalReply] = []
        for index, choice in enumerate(self._choices):
            if choice.text or choice.token_ids:
                messages.append(self._take(index))
        choices = None
        if len(self._choices) > 1:
            choices = [
                Choice(
                    index=index, text="".join(c.parts), completion_tokens=c.num_tokens,
                    finish_reason=c.finish_reason or finish_reason,
                )  # fmt: skip
                for index, c in enumerate(self._choices)
            ]
        final = FinalReply(
            id=self.request_id,
            attempt=self.attempt,
            seq=self._next_seq,
            nonce=self.nonce,
            finish_reason=finish_reason,
            text=self.text,
            usage=usage,
            timing=timing,
            error=error,
            choices=choices,
        )
        self._next_seq += 1
        self.finish_reason = finish_reason
        messages.append(final)
        return messages

    def _take(self, index: int) -> TokenReply:
        choice = self._choices[index]
        message = TokenReply(
            id=self.request_id,
            attempt=self.attempt,
            seq=self._next_seq,
            nonce=self.nonce,
            text="".join(choice.text),
            token_ids=choice.token_ids,
            logprobs=choice.logprobs,
            index=index if len(self._choices) > 1 else None,
        )
        self._next_seq += 1
        choice.num_sent += 1
        choice.text = []
        choice.token_ids = []
        choice.logprobs = None
        return message
