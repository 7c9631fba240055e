"""Keep UTF-16 surrogate code points (U+D800-U+DFFF) out of a grammar's character classes.

xgrammar's UTF-8 automaton takes ED A0..BF xx as a character, though it is not valid UTF-8: a
byte-level tokenizer can spell it byte by byte, and the text then decodes to U+FFFD (found by
hypothesis with a regex `.`, which xgrammar writes as [\\0-\\U0010ffff]). A grammar's EBNF text
(as xgrammar prints it) is rewritten: a negated class also excludes the surrogates, a range
that spans them is split around them. A string literal or a class that holds nothing but
surrogates cannot be made text, so it is a ValueError.
"""

from __future__ import annotations

SURROGATES = (0xD800, 0xDFFF)
_EXCLUDED = r"\ud800-\udfff"
# EBNF escapes with one letter, as xgrammar prints them.
_SHORT_ESCAPES = {"0": 0, "b": 8, "f": 12, "n": 10, "r": 13, "t": 9, "v": 11}
_HEX_DIGITS = {"x": 2, "u": 4, "U": 8}


def is_surrogate(code_point: int) -> bool:
    return SURROGATES[0] <= code_point <= SURROGATES[1]


def exclude_surrogates(ebnf: str) -> str:
    """`ebnf` with no character class or literal that can produce a surrogate code point."""
    out: list[str] = []
    i = 0
    while i < len(ebnf):
        if ebnf[i] == '"':
            end = _literal_end(ebnf, i)
            out.append(ebnf[i:end])
            i = end
        elif ebnf[i] == "[":
            end, text = _rewrite_class(ebnf, i)
            out.append(text)
            i = end
        else:
            out.append(ebnf[i])
            i += 1
    return "".join(out)


def _read_char(text: str, i: int) -> tuple[int, int]:
    """The code point at text[i] (a character or an escape) and the index after it."""
    if text[i] != "\\":
        return ord(text[i]), i + 1
    letter = text[i + 1]
    if letter in _HEX_DIGITS:
        end = i + 2 + _HEX_DIGITS[letter]
        return int(text[i + 2 : end], 16), end
    return _SHORT_ESCAPES.get(letter, ord(letter)), i + 2


def _literal_end(text: str, start: int) -> int:
    """The index after the string literal opening at `start`; checks its characters."""
    i = start + 1
    while text[i] != '"':
        code_point, i = _read_char(text, i)
        if is_surrogate(code_point):
            raise ValueError(
                f"the grammar would emit the UTF-16 surrogate U+{code_point:04X}, which is not text"
            )
    return i + 1


def _rewrite_class(text: str, start: int) -> tuple[int, str]:
    """(index after the class opening at `start`, its rewritten text)."""
    i = start + 1
    is_negated = text[i] == "^"
    i += is_negated
    ranges = []
    while text[i] != "]":
        low, i = _read_char(text, i)
        high = low
        if text[i] == "-" and text[i + 1] != "]":
            high, i = _read_char(text, i + 1)
        ranges.append((low, high))
    original = text[start : i + 1]
    if is_negated:
        return i + 1, original[:-1] + _EXCLUDED + "]"
    if not any(low <= SURROGATES[1] and high >= SURROGATES[0] for low, high in ranges):
        return i + 1, original
    kept = []
    for low, high in ranges:
        if low < SURROGATES[0]:
            kept.append((low, min(high, SURROGATES[0] - 1)))
        if high > SURROGATES[1]:
            kept.append((max(low, SURROGATES[1] + 1), high))
    if not kept:
        raise ValueError("the grammar has a character class of UTF-16 surrogates only, not text")
    body = "".join(_escaped(lo) + ("" if lo == hi else "-" + _escaped(hi)) for lo, hi in kept)
    return i + 1, "[" + body + "]"


def _escaped(code_point: int) -> str:
    return f"\\U{code_point:08x}"
