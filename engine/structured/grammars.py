"""Compiled grammars, cached by spec, and the per-request matcher the sampler and engine use."""

from __future__ import annotations

import json
import re
from collections import OrderedDict

import torch
import xgrammar

from engine.sampling_params import StructuredOutput
from engine.structured.surrogates import exclude_surrogates

# Compiled grammars kept per engine: a JSON schema compiles in about 0.1-0.2 s, a cache hit is
# a dict lookup. Pipelines send a handful of schemas many times, so a small LRU is plenty.
MAX_NUM_CACHED_GRAMMARS = 256
# One character of a JSON string, as xgrammar's EBNF writes it: loose (only quote, backslash,
# CR and LF excluded) and strict (every control character excluded, as RFC 8259 requires).
_LOOSE_STRING_CHAR = r"[^\"\\\r\n]"  # xgrammar's maxLength-bounded string character
_UNBOUNDED_STRING_CHAR = r"[^\0-\x1f\"\\\r\n]"  # its unbounded-string character
# No control characters, and no UTF-16 surrogate code points: xgrammar's UTF-8 automaton takes
# ED A0..BF xx as a character, which is not valid UTF-8 (a byte-level tokenizer can emit it
# byte by byte, and the text then decodes to U+FFFD).
_STRICT_STRING_CHAR = r"[^\0-\x1f\"\\\uD800-\uDFFF]"
_SOURCE_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


class GrammarMatcher:
    """One request's position in its grammar. It accepts exactly the request's output tokens
    (the engine advances it with each token it appends), so it needs no rollback: a preempted
    request is recomputed with the same tokens and resumes from the same state."""

    __slots__ = ("_matcher",)

    def __init__(self, compiled: xgrammar.CompiledGrammar) -> None:
        self._matcher = xgrammar.GrammarMatcher(compiled)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] ([num_rows, ceil(vocab / 32)] int32,
        bit i of word w = token 32 * w + i)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by one token; False if the grammar does not allow it (the state is kept)."""
        return self._matcher.accept_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted: nothing more may follow."""
        return self._matcher.is_terminated()


class GrammarCache:
    """Compiles `StructuredOutput` specs against one tokenizer; a spec seen before is not
    compiled again. The model's vocabulary can be larger than the tokenizer's (padding rows):
    those ids are never allowed."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
        )
        self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self._compiled: OrderedDict[tuple, xgrammar.CompiledGrammar] = OrderedDict()

    def matcher(self, structured: StructuredOutput) -> GrammarMatcher:
        """A fresh matcher at the grammar's start. Raises ValueError for a spec that does not
        compile (its message says why)."""
        key = (structured.type, structured.spec)
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compile(structured)
            self._compiled[key] = compiled
            if len(self._compiled) > MAX_NUM_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        return GrammarMatcher(compiled)

    @property
    def num_cached(self) -> int:
        return len(self._compiled)

    def _compile_json_schema(self, schema: str) -> xgrammar.CompiledGrammar:
        # No free whitespace: a small model would otherwise spend its tokens on it.
        grammar = xgrammar.Grammar.from_json_schema(schema, any_whitespace=False)
        return self._compiler.compile_grammar(_strict_json_strings(str(grammar)))

    def _compile(self, structured: StructuredOutput) -> xgrammar.CompiledGrammar:
        kind, spec = structured.type, structured.spec
        try:
            if kind == "json_object":
                # OpenAI's JSON mode: any JSON object (not any JSON value).
                return self._compile_json_schema('{"type": "object"}')
            if kind == "json_schema":
                if not isinstance(json.loads(spec), dict):
                    raise ValueError("the schema must be a JSON object")
                return self._compile_json_schema(spec)
            if kind == "regex":  # through its EBNF, to keep surrogates out of its classes
                ebnf = str(xgrammar.Grammar.from_regex(spec))
                return self._compiler.compile_grammar(exclude_surrogates(ebnf))
            # choice: one EBNF rule of string literals; JSON string escapes are EBNF's.
            alternatives = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in spec)
            return self._compiler.compile_grammar(exclude_surrogates(f"root ::= {alternatives}"))
        except (RuntimeError, ValueError, TypeError) as error:
            raise ValueError(
                f"invalid {kind} for structured output: {_first_line(error)}"
            ) from None


def _strict_json_strings(ebnf: str) -> str:
    """xgrammar 0.2's rule for a length-bounded string (`maxLength`) lets raw control characters
    through, which strict JSON parsers reject, and both of its string rules let surrogate code
    points through, which are not UTF-8. Both rules get the strict character class."""
    return ebnf.replace(_LOOSE_STRING_CHAR, _STRICT_STRING_CHAR).replace(
        _UNBOUNDED_STRING_CHAR, _STRICT_STRING_CHAR
    )


def _first_line(error: Exception) -> str:
    """The library's message without its C++ source location (`[hh:mm:ss] file.cc:123: `)."""
    text = str(error).strip() or type(error).__name__
    return _SOURCE_LOCATION.sub("", text.splitlines()[0])[:300]
