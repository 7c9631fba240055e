"""Turn the replies of one request, possibly from several attempts, into what the user sees.

Pure logic (no asyncio, no Kafka) so that every interleaving can be tested exhaustively.

Under redelivery a request can be generated twice (docs/CONTRACT.md, "Delivery semantics"): attempt A
streams some messages and dies, attempt B starts again from seq 0. The client rule:
- Follow the attempt that has got furthest. Messages of another attempt that agree with what
  was shown are duplicates and are dropped; once that attempt gets further, it takes over.
- A message that disagrees with what was shown means the retry diverged: switch to it, give up
  the old attempt (it is almost always dead), and emit a restart with the replacement text.
- The first final wins: its text is authoritative, whatever was streamed. Later replies drop.

Invariant (tested): applying the deltas in order (append `text`, or replace everything with it
when `is_restart`) gives exactly the winning final's `text`. With n > 1 (contract v1.2) the
same holds per choice: deltas of choice `index` give that choice's text in the final.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas.messages import FinalReply, TokenLogprob, TokenReply


@dataclass
class Delta:
    """New output for the user. `is_restart`: `text` (and `token_ids`, `logprobs`) replace the
    whole stream so far (of choice `index`). `logprobs`: one entry per token of `token_ids`
    when the request asked for them (`logprobs` / `top_logprobs`), else None. `index`: the
    choice (0 unless the request asked for n > 1)."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    is_restart: bool = False
    final: FinalReply | None = None
    logprobs: list[TokenLogprob] | None = None
    index: int = 0


@dataclass
class _Attempt:
    """Messages of one attempt: the contiguous run from seq 0, and any that came early."""

    contiguous: list[TokenReply] = field(default_factory=list)
    early: dict[int, TokenReply] = field(default_factory=dict)

    def add(self, reply: TokenReply) -> bool:
        """Store `reply`; False if this seq was already seen (a redelivered duplicate)."""
        if reply.seq < len(self.contiguous) or reply.seq in self.early:
            return False
        self.early[reply.seq] = reply
        while len(self.contiguous) in self.early:
            self.contiguous.append(self.early.pop(len(self.contiguous)))
        return True


class ReplyAssembler:
    """Feed every reply of one request id; get back the deltas to show, in order."""

    def __init__(self) -> None:
        self._attempts: dict[str, _Attempt] = {}
        self._abandoned: set[str] = set()
        self._followed: str | None = None
        self._shown: list[TokenReply] = []  # the messages whose text the user now sees
        self.final: FinalReply | None = None
        self.num_dropped = 0
        self.num_restarts = 0

    @property
    def is_done(self) -> bool:
        return self.final is not None

    @property
    def shown_text(self) -> str:
        """Choice 0's text shown so far (the only choice for n=1)."""
        return self.shown_text_of(0)

    def shown_text_of(self, index: int) -> str:
        return "".join(m.text for m in self._shown if (m.index or 0) == index)

    def feed(self, reply: TokenReply | FinalReply) -> list[Delta]:
        if self.is_done:
            self.num_dropped += 1
            return []
        if isinstance(reply, FinalReply):
            return self._finish(reply)  # even from an abandoned attempt: the first final wins
        if reply.attempt in self._abandoned:
            self.num_dropped += 1
            return []
        attempt = self._attempts.setdefault(reply.attempt, _Attempt())
        if not attempt.add(reply):
            self.num_dropped += 1
            return []
        if self._followed is None:
            self._followed = reply.attempt
        if reply.attempt == self._followed:
            return self._extend(attempt.contiguous)
        return self._compare(reply.attempt, attempt.contiguous)

    def _compare(self, name: str, messages: list[TokenReply]) -> list[Delta]:
        """Another attempt advanced: a duplicate, a takeover, or a divergence."""
        num_common = min(len(messages), len(self._shown))
        if any(not _same(messages[i], self._shown[i]) for i in range(num_common)):
            indexes = sorted({m.index or 0 for m in [*messages, *self._shown]})
            self._abandoned.add(self._followed)
            self._followed = name
            self._shown = list(messages)
            self.num_restarts += 1
            return [self._restart(index) for index in indexes]
        if len(messages) <= len(self._shown):
            self.num_dropped += 1
            return []
        self._followed = name  # it agrees so far and has got further: the highest seq leads
        return self._extend(messages)

    def _extend(self, messages: list[TokenReply]) -> list[Delta]:
        """`messages` agree with what was shown; show the ones beyond it."""
        new = messages[len(self._shown) :]
        self._shown.extend(new)
        return [
            Delta(m.text, list(m.token_ids), logprobs=m.logprobs, index=m.index or 0) for m in new
        ]

    def _restart(self, index: int) -> Delta:
        """Choice `index` replaced by what the followed attempt has shown of it."""
        messages = [m for m in self._shown if (m.index or 0) == index]
        token_ids = [t for m in messages for t in m.token_ids]
        return Delta(
            self.shown_text_of(index), token_ids, True, logprobs=_joined_logprobs(messages),
            index=index,
        )  # fmt: skip

    def _finish(self, final: FinalReply) -> list[Delta]:
        """The final's text is authoritative. Token ids of text that only the final carries
        (a gap in the stream, another attempt) are unknown, so that delta has none. With n > 1
        each choice gets its delta; the last one carries the final."""
        self.final = final
        texts = [(c.index, c.text) for c in final.choices] if final.choices else [(0, final.text)]
        deltas = []
        for index, text in texts:
            shown_text = self.shown_text_of(index)
            if text.startswith(shown_text):
                deltas.append(Delta(text[len(shown_text) :], [], index=index))
            else:
                self.num_restarts += 1
                deltas.append(Delta(text, [], is_restart=True, index=index))
        deltas[-1].final = final
        return deltas


def _same(a: TokenReply, b: TokenReply) -> bool:
    """Two attempts' messages at one seq agree: same choice, same text."""
    return (a.index or 0) == (b.index or 0) and a.text == b.text


def _joined_logprobs(messages: list[TokenReply]) -> list[TokenLogprob] | None:
    """The logprobs of a run of messages, or None if any message has none."""
    if not messages or any(m.logprobs is None for m in messages):
        return None
    return [entry for m in messages for entry in m.logprobs]
