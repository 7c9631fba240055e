"""engine/tokenizer.py against transformers' own tokenizer on the same files: token ids, decoded
text, special tokens and rendered chat prompts must be identical."""

import json
import shutil

import pytest
import tokenizers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jinja2.exceptions import SecurityError, TemplateError
from transformers import AutoTokenizer

from engine import loader, tokenizer
from tests.tiny_model import make_tokenizer

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
TEXTS = [
    "", " ", "hello world", "  leading and trailing  ", "a\n\nb\r\n\tc", "Ünïcödé 🚀🔥 漢字かな",
    "<|im_start|>user\nhi<|im_end|>", "x<|im_end|>y", "<|im_end", "\x00\x1f\ufffd", "é" * 40,
]  # fmt: skip
# A template that uses what transformers' environment adds to jinja's.
FEATURE_TEMPLATE = (
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'skip' %}{% continue %}"
    "{% endif %}{% set ns.n = ns.n + 1 %}{% generation %}<|im_start|>{{ m.role }}\n"
    "{{ m.content | trim }}<|im_end|>\n{% endgeneration %}{% endfor %}"
    "{% if tools %}{{ tools | tojson }}{% endif %}{{ bos_token }}{{ ns.n }}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(ours, transformers') on the tests' tiny byte-level BPE tokenizer and its template."""
    path = tmp_path_factory.mktemp("tok")
    make_tokenizer().save_pretrained(path)
    return tokenizer.load(path), AutoTokenizer.from_pretrained(path)


def _assert_same_encoding(ours, theirs, text: str) -> None:
    for add in (True, False):
        for split in (False, True):
            expected = theirs.encode(text, add_special_tokens=add, split_special_tokens=split)
            assert ours.encode(text, add_special_tokens=add, split_special_tokens=split) == (
                expected
            ), (text, add, split)
    ids = theirs.encode(text)
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
            ids, skip_special_tokens=skip
        )


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(pair, text):
    _assert_same_encoding(*pair, text)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(st.one_of(st.text(max_size=30), st.sampled_from(SPECIALS)), max_size=6))
def test_encode_decode_match_transformers_on_generated_text(pair, parts):
    _assert_same_encoding(*pair, "".join(parts))


@settings(
    max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(st.integers(0, 400), max_size=20))
def test_decode_of_any_ids_matches_transformers(pair, ids):
    ours, theirs = pair
    ids = [i % len(theirs) for i in ids]
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
            ids, skip_special_tokens=skip
        )


def test_special_tokens_match_transformers(pair):
    ours, theirs = pair
    assert ours.special_tokens_map == theirs.special_tokens_map
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id,
    )  # fmt: skip
    assert ours.added_tokens_encoder == theirs.added_tokens_encoder
    assert ours.get_vocab() == theirs.get_vocab() and len(ours) == len(theirs)


MESSAGES = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " <|im_end|> x "}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b 🚀"},
     {"role": "skip", "content": "c"}, {"role": "user", "content": "d\n"}],
]  # fmt: skip


@pytest.mark.parametrize("messages", MESSAGES)
@pytest.mark.parametrize("template", [None, FEATURE_TEMPLATE])
def test_chat_template_renders_as_transformers(pair, messages, template):
    ours, theirs = pair
    for generation_prompt in (False, True):
        kwargs = {"add_generation_prompt": generation_prompt}
        if template is not None:
            kwargs.update(chat_template=template, tools=[{"name": "f", "description": "<&>"}])
        text = ours.apply_chat_template(messages, tokenize=False, **kwargs)
        ids = ours.apply_chat_template(messages, **kwargs)
        assert text == theirs.apply_chat_template(messages, tokenize=False, **kwargs)
        expected = theirs.apply_chat_template(messages, return_dict=False, **kwargs)
        assert ids == list(expected)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(
        st.tuples(st.sampled_from(["system", "user", "assistant"]), st.text(max_size=20)),
        min_size=1, max_size=4,
    )
)  # fmt: skip
def test_chat_prompts_of_generated_messages_match_transformers(pair, turns):
    ours, theirs = pair
    messages = [{"role": r, "content": c} for r, c in turns]
    kwargs = {"add_generation_prompt": True, "tokenize": False}
    text = ours.apply_chat_template(messages, **kwargs)
    assert text == theirs.apply_chat_template(messages, **kwargs)
    assert ours.encode(text) == theirs.encode(text)


def test_template_errors_and_sandbox(pair):
    ours, _ = pair
    ours.chat_template, saved = "{{ raise_exception('no system role') }}", ours.chat_template
    try:
        with pytest.raises(TemplateError, match="no system role"):
            ours.apply_chat_template(MESSAGES[0], tokenize=False)
        ours.chat_template = "{% set ns = namespace() %}{% set ns._x = 1 %}"
        with pytest.raises(SecurityError, match="_x"):
            ours.apply_chat_template(MESSAGES[0], tokenize=False)
        ours.chat_template = "{{ messages.__class__ }}"  # the sandbox hides dunders
        assert ours.apply_chat_template(MESSAGES[0], tokenize=False) == ""
        ours.chat_template = "{{ messages.append(1) }}"  # and refuses mutation
        with pytest.raises(SecurityError):
            ours.apply_chat_template(MESSAGES[0], tokenize=False)
        ours.chat_template = None
        with pytest.raises(ValueError, match="no chat template"):
            ours.apply_chat_template(MESSAGES[0], tokenize=False)
    finally:
        ours.chat_template = saved
    with pytest.raises(TypeError, match="JSON data"):
        ours.apply_chat_template([{"role": "user", "content": object()}], tokenize=False)


def _edited_copy(src, dst, **config_changes):
    shutil.copytree(src, dst)
    config_file = dst / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.update(config_changes)
    config_file.write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("flags", [{"add_bos_token": True}, {"add_eos_token": True}])
def test_bos_eos_flags_are_ignored_as_transformers_does(tmp_path, flags):
    src = tmp_path / "src"
    make_tokenizer().save_pretrained(src)
    path = _edited_copy(src, tmp_path / "flags", **flags)
    ours, theirs = tokenizer.load(path), AutoTokenizer.from_pretrained(path)
    for text in TEXTS:  # tokenizer.json's post-processor decides
        _assert_same_encoding(ours, theirs, text)


def test_truncation_and_padding_in_tokenizer_json_are_off_as_in_transformers(tmp_path):
    path = tmp_path / "padded"
    make_tokenizer().save_pretrained(path)
    backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    backend.enable_truncation(3)
    backend.enable_padding(length=12, pad_id=0)
    backend.save(str(path / "tokenizer.json"))
    ours, theirs = tokenizer.load(path), AutoTokenizer.from_pretrained(path)
    for text in TEXTS:
        _assert_same_encoding(ours, theirs, text)
    assert len(ours.encode(TEXTS[5])) > 3


def test_named_chat_templates_as_transformers(tmp_path):
    path = tmp_path / "named"
    make_tokenizer().save_pretrained(path)
    (path / "additional_chat_templates").mkdir()
    (path / "additional_chat_templates" / "tool_use.jinja").write_text("TOOLS {{ tools | tojson }}")
    ours, theirs = tokenizer.load(path), AutoTokenizer.from_pretrained(path)
    assert ours.chat_template == theirs.chat_template and isinstance(ours.chat_template, dict)
    for kwargs in ({}, {"tools": [{"name": "f"}]}):
        assert ours.apply_chat_template(MESSAGES[0], tokenize=False, **kwargs) == (
            theirs.apply_chat_template(MESSAGES[0], tokenize=False, **kwargs)
        )


def test_special_token_missing_from_the_vocabulary_is_added(tmp_path):
    src = tmp_path / "src"
    make_tokenizer().save_pretrained(src)
    path = _edited_copy(src, tmp_path / "mask", mask_token="<mask>")
    ours, theirs = tokenizer.load(path), AutoTokenizer.from_pretrained(path)
    assert ours.encode("a <mask> b") == theirs.encode("a <mask> b")
    assert ours.added_tokens_encoder == theirs.added_tokens_encoder


def test_model_specific_classes_fall_back_to_transformers(tmp_path):
    src = tmp_path / "src"
    make_tokenizer().save_pretrained(src)
    for i, change in enumerate([{"tokenizer_class": "LlamaTokenizer"},
                                {"clean_up_tokenization_spaces": True},
                                {"add_prefix_space": True}, {}]):  # fmt: skip
        path = _edited_copy(src, tmp_path / f"other{i}", **change)
        if not change:  # a Mistral checkpoint: transformers may patch its regex
            (path / "config.json").write_text(json.dumps({"model_type": "mistral"}))
        assert tokenizer.load(path) is None
        assert not isinstance(loader.load_tokenizer(path), tokenizer.Tokenizer)
    assert isinstance(loader.load_tokenizer(src), tokenizer.Tokenizer)
    assert tokenizer.load(tmp_path) is None  # no tokenizer.json


def test_as_transformers_gives_the_same_vocabulary(pair):
    ours, theirs = pair
    converted = tokenizer.as_transformers(ours)
    assert type(converted) is type(theirs) and converted.get_vocab() == ours.get_vocab()
    assert tokenizer.as_transformers(theirs) is theirs


@pytest.mark.real_model
def test_default_model_tokenizer_matches_transformers():
    path = loader.fetch_default_model(progress=False)
    ours, theirs = tokenizer.load(path), AutoTokenizer.from_pretrained(path)
    assert isinstance(loader.load_tokenizer(path), tokenizer.Tokenizer)
    for text in TEXTS + ["The capital of France is Paris. 1234567 + 89 = ?"]:
        _assert_same_encoding(ours, theirs, text)
    for messages in MESSAGES[:2]:
        kwargs = {"add_generation_prompt": True, "tokenize": False}
        assert ours.apply_chat_template(messages, **kwargs) == theirs.apply_chat_template(
            messages, **kwargs
        )
    assert ours.eos_token_id == theirs.eos_token_id and ours.bos_token_id == theirs.bos_token_id
