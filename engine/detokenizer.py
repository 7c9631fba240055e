"""Incremental detokenization and stop strings.

Text deltas must never split a character and must concatenate to the final text. Decoding one
token at a time does not work: a byte-level BPE token can hold half of a UTF-8 character, and
SentencePiece drops a token's leading space at the start of a decode. With a fast tokenizer
(`tokenizers` underneath, the usual case) its `DecodeStream` does it in Rust, one call per
token: it keeps the window itself, seeded with the prompt's last tokens, and returns text only
once a character is complete. Otherwise, as vLLM does, each step decodes a small window twice
(with and without the new tokens) and emits the difference only once it no longer ends in U+FFFD
(an incomplete character): two Python-level decodes per token. Both give the same text (tested).

Stop strings are searched in the text; the last `max_stop_len - 1` characters are held back
until they can no longer be the start of a stop string, so no delta ever contains part of one.
"""

from __future__ import annotations

from engine.sampling_params import SamplingParams

try:  # tokenizers >= 0.21
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover - older tokenizers: the window decode below
    DecodeStream = None

_REPLACEMENT = "\ufffd"
_INITIAL_WINDOW = 5  # prompt tokens decoded as context for the first output tokens


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        params: SamplingParams,
        use_stream: bool = True,
    ) -> None:
        """`use_stream` False forces the window decode (the reference, for tests)."""
        self.tokenizer = tokenizer
        self.stop = params.stop
        self._holdback = max(params.max_stop_len - 1, 0)
        self._ids = list(prompt_token_ids[-_INITIAL_WINDOW:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""  # decoded output text (stop string and what follows it cut off)
        self._num_emitted = 0  # characters of `text` already handed out as deltas
        self.stopped_on: str | None = None
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = None
        if use_stream and backend is not None and DecodeStream is not None:
            self._backend = backend
            self._stream = DecodeStream(ids=list(self._ids), skip_special_tokens=True)
            self._pending: list[int] = []  # tokens the stream holds back (half a character)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add_token(self, token_id: int, *, is_last: bool = False) -> None:
        """Append one output token; set `stopped_on` if a stop string completed."""
        if self.tokenizer is None or self.stopped_on is not None:
            return
        if self._stream is not None:
            appended = self._stream_step(token_id, is_last)
            if appended:
                self._append(appended)
            return
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or (new_text.endswith(_REPLACEMENT) and not is_last):
            return  # nothing printable yet (special token, or half a character)
        appended = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._append(appended)

    def _stream_step(self, token_id: int, is_last: bool) -> str | None:
        chunk = self._stream.step(self._backend, token_id)
        self._pending.append(token_id)
        if chunk is None and is_last:  # a last, incomplete character: its U+FFFD, as the
            chunk = self._decode(self._pending)  # window decode gives
        if chunk is not None:
            self._pending = []
        return chunk

    def _append(self, appended: str) -> None:
        search_from = max(len(self.text) - self._holdback, 0)
        self.text += appended
        if self.stop:
            self._check_stop(search_from)

    def _check_stop(self, search_from: int) -> None:
        best = None
        for s in self.stop:
            i = self.text.find(s, search_from)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            self.text = self.text[: best[0]]
            self.stopped_on = best[1]

    def flush(self, finished: bool) -> str:
        """The next text delta: everything that can no longer change or turn into a stop string."""
        end = len(self.text) if finished or self.stopped_on else len(self.text) - self._holdback
        if end <= self._num_emitted:
            return ""
        delta = self.text[self._num_emitted : end]
        self._num_emitted = end
        return delta
