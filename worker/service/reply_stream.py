"""The replies of one attempt: where token messages start and end, their `seq`, and the final.

Message boundaries depend only on the generated tokens, never on timing: a message closes once
it holds `tokens_per_message` tokens and some text (1: every engine text delta), and whatever is
left goes out just before the final. So two attempts that generate the same tokens publish the
same messages with the same `seq`, and a client can tell a duplicate from a divergence by
comparing texts at equal `seq`. Pure: no Kafka, no clock.
"""

from __future__ import annotations

from schemas.messages import ErrorInfo, FinalReply, Timing, TokenLogprob, TokenReply, Usage


class ReplyStream:
    def __init__(
        self,
        request_id: str,
        attempt: str,
        tokens_per_message: int,
        is_streaming: bool,
        nonce: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.nonce = nonce  # the request's, echoed in every reply (contract v1.2)
        self.attempt = attempt
        self.tokens_per_message = tokens_per_message
        self.is_streaming = is_streaming
        self._parts: list[str] = []  # every text delta: the final's text is their concatenation
        self._buffered_text: list[str] = []
        self._buffered_token_ids: list[int] = []
        self._buffered_logprobs: list[TokenLogprob] | None = None
        self._next_seq = 0
        self.finish_reason: str | None = None  # set once the final is made

    @property
    def text(self) -> str:
        return "".join(self._parts)

    @property
    def num_messages(self) -> int:
        return self._next_seq

    def add(
        self, text: str, token_ids: list[int], logprobs: list[TokenLogprob] | None = None
    ) -> list[TokenReply]:
        """One engine delta in; the token messages it completes out (none when not streaming).
        `logprobs`, when the request asked for them, has one entry per token of `token_ids`."""
        if text:
            self._parts.append(text)
        if not self.is_streaming:
            return []
        if text:
            self._buffered_text.append(text)
        self._buffered_token_ids.extend(token_ids)
        if logprobs is not None:
            self._buffered_logprobs = (self._buffered_logprobs or []) + logprobs
        if self._buffered_text and len(self._buffered_token_ids) >= self.tokens_per_message:
            return [self._take()]
        return []

    def finish(
        self,
        finish_reason: str,
        usage: Usage,
        timing: Timing,
        error: ErrorInfo | None = None,
    ) -> list[TokenReply | FinalReply]:
        """The last token message (what is still buffered) and the final, in that order."""
        if self.finish_reason is not None:
            raise RuntimeError(f"attempt {self.attempt} already has its final")
        messages: list[TokenReply | FinalReply] = []
        if self._buffered_text or self._buffered_token_ids:
            messages.append(self._take())
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
        )
        self._next_seq += 1
        self.finish_reason = finish_reason
        messages.append(final)
        return messages

    def _take(self) -> TokenReply:
        message = TokenReply(
            id=self.request_id,
            attempt=self.attempt,
            seq=self._next_seq,
            nonce=self.nonce,
            text="".join(self._buffered_text),
            token_ids=self._buffered_token_ids,
            logprobs=self._buffered_logprobs,
        )
        self._next_seq += 1
        self._buffered_text = []
        self._buffered_token_ids = []
        self._buffered_logprobs = None
        return message
