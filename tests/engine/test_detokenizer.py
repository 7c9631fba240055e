"""Incremental detokenization: deltas never split a character, concatenate to the final text,
and never contain (part of) a stop string."""

import functools

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams
from tests.tiny_model import make_tokenizer


@functools.cache
def _tok():
    return make_tokenizer()


def _run(text_ids, stop=(), prompt_ids=(1, 2, 3), use_stream=True):
    tok = _tok()
    params = SamplingParams(stop=stop)
    detok = IncrementalDetokenizer(tok, list(prompt_ids), params, use_stream=use_stream)
    deltas = []
    for i, t in enumerate(text_ids):
        detok.add_token(t, is_last=i == len(text_ids) - 1)
        finished = i == len(text_ids) - 1 or detok.stopped_on is not None
        deltas.append(detok.flush(finished))
        if detok.stopped_on is not None:
            break
    return detok, deltas


texts = st.text(
    alphabet=st.sampled_from(list("ab cdé漢字🚀\n.,") + ["ü", "ß", "\t"]), min_size=1, max_size=40
)


@settings(max_examples=200, deadline=None)
@given(texts)
def test_deltas_concatenate_and_never_split_characters(text):
    ids = _tok().encode(text)
    detok, deltas = _run(ids)
    assert "".join(deltas) == detok.text == _tok().decode(ids)
    assert all("\ufffd" not in d for d in deltas)


@settings(max_examples=200, deadline=None)
@given(texts, texts, st.sampled_from(["STOP", "é漢", "\n\n", "a"]))
def test_stop_string_cut_across_token_boundaries(before, after, stop):
    text = before + stop + after
    ids = _tok().encode(text)
    detok, deltas = _run(ids, stop=(stop,))
    expected = text[: text.find(stop)]
    assert detok.stopped_on == stop
    assert "".join(deltas) == expected
    # No delta ever showed any part of the stop string that the final text does not contain.
    shown = ""
    for d in deltas:
        shown += d
        assert expected.startswith(shown)


def test_stop_string_spanning_tokens_is_held_back():
    tok = _tok()
    ids = tok.encode("hello world END trailing")
    detok, deltas = _run(ids, stop=("END",))
    assert "".join(deltas) == "hello world "
    assert detok.stopped_on == "END"


def test_special_tokens_are_not_text():
    tok = _tok()
    ids = tok.encode("abc") + [tok.eos_token_id]
    _, deltas = _run(ids)
    assert "".join(deltas) == "abc"


def test_the_stream_is_used_for_a_fast_tokenizer():
    assert IncrementalDetokenizer(_tok(), [1], SamplingParams())._stream is not None
    assert IncrementalDetokenizer(_tok(), [1], SamplingParams(), use_stream=False)._stream is None


@settings(max_examples=200, deadline=None)
@given(texts, st.sampled_from([(), ("é漢",), ("\n\n",), ("a",)]), st.integers(0, 2))
def test_decode_stream_gives_the_window_decodes_deltas(text, stop, num_cut):
    """DecodeStream (one Rust call per token) against the window decode (the reference): the
    same deltas token by token, stop strings included, also when the last character is cut
    (its U+FFFD at the end, as the reference gives)."""
    ids = _tok().encode(text)
    ids = ids[: max(1, len(ids) - num_cut)] if num_cut and len(ids) > 1 else ids
    stream, stream_deltas = _run(ids, stop=stop)
    window, window_deltas = _run(ids, stop=stop, use_stream=False)
    assert stream_deltas == window_deltas
    assert (stream.text, stream.stopped_on) == (window.text, window.stopped_on)
