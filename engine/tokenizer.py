"""The checkpoint's tokenizer on the `tokenizers` library directly, without transformers.

A Hugging Face fast tokenizer is a `tokenizers.Tokenizer` (the Rust one, read from
tokenizer.json) plus Python around it: special-token attributes from tokenizer_config.json and the chat template
rendered with jinja2 (with a tokenizer.json, transformers ignores the config's add_bos_token and
add_eos_token: tokenizer.json's post-processor decides, here too). Loading it
through `AutoTokenizer` imports much of transformers: measured on SmolLM2 (2-core Zen 4),
+120 MiB of RSS against +33 MiB for the `tokenizers.Tokenizer` alone, which is most of the gap
to llama.cpp's memory (issue 17). `Tokenizer` is the subset the engine and worker use (`encode`,
`decode`, `apply_chat_template`, the special tokens), with transformers' semantics; tests check
token ids, texts and rendered prompts against transformers' own tokenizer.

Only the generic classes (what `save_pretrained` writes for a fast tokenizer, GPT-2 / Qwen2
byte-level BPE) load this way: a model-specific class (Llama's SentencePiece legacy mode,
Gemma, ...) may rebuild its normalizer or decoder in Python, so `load` returns None for it and
the caller falls back to transformers.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken

# tokenizer_config.json's `tokenizer_class` values whose transformers class adds nothing to the
# tokenizer.json pipeline (beyond what `Tokenizer` does: the special tokens).
GENERIC_CLASSES = frozenset(
    {"TokenizersBackend", "PreTrainedTokenizerFast", "GPT2Tokenizer", "GPT2TokenizerFast",
     "Qwen2Tokenizer", "Qwen2TokenizerFast"}
)  # fmt: skip
# transformers' named special tokens (SPECIAL_TOKENS_ATTRIBUTES), passed to chat templates.
SPECIAL_TOKEN_NAMES = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"
)  # fmt: skip


def load(path: Path) -> Tokenizer | None:
    """The tokenizer of checkpoint directory `path`, or None when it has no tokenizer.json or
    its tokenizer_config.json asks for something only transformers does (see module doc)."""
    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        return None
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    if config.get("tokenizer_class", "TokenizersBackend") not in GENERIC_CLASSES:
        return None
    if config.get("clean_up_tokenization_spaces") or config.get("split_special_tokens"):
        return None  # transformers' cleanup and default splitting: not reproduced here
    if config.get("auto_map") or config.get("add_prefix_space") is not None:
        return None  # remote code; a pre-tokenizer transformers rewrites
    if "mistral" in _model_type(path) or "mixtral" in _model_type(path):
        return None  # transformers may patch these tokenizers' pre-tokenizer regex
    backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer = Tokenizer(backend, config, _chat_template(path, config))
    tokenizer.path = path
    return tokenizer


def as_transformers(tokenizer):
    """transformers' own tokenizer for one that `load` made (for libraries that take only
    that: xgrammar), loaded from the same files; any other tokenizer as it is."""
    if not isinstance(tokenizer, Tokenizer) or tokenizer.path is None:
        return tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer.path)


def _model_type(path: Path) -> str:
    config_file = path / "config.json"
    if not config_file.is_file():
        return ""
    return str(json.loads(config_file.read_text()).get("model_type", ""))


def _chat_template(path: Path, config: dict) -> str | dict[str, str] | None:
    """As transformers reads it: chat_template.jinja ("default") and additional_chat_templates/
    NAME.jinja files take priority over tokenizer_config.json's entry (one template, or a list
    of named ones)."""
    templates = {}
    if (path / "chat_template.jinja").is_file():
        templates["default"] = (path / "chat_template.jinja").read_text()
    for file in sorted((path / "additional_chat_templates").glob("*.jinja")):
        templates[file.stem] = file.read_text()
    if templates:
        return templates["default"] if list(templates) == ["default"] else templates
    template = config.get("chat_template")
    if isinstance(template, list):
        return {t["name"]: t["template"] for t in template}
    return template


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken's dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """transformers' fast-tokenizer calls the engine and worker make, on `tokenizers` alone."""

    def __init__(self, backend: tokenizers.Tokenizer, config: dict, chat_template=None) -> None:
        self.backend_tokenizer = backend
        self.path: Path | None = None  # the checkpoint directory, when loaded from one
        self.chat_template = chat_template
        self.special_tokens_map = {
            name: text
            for name in SPECIAL_TOKEN_NAMES
            if (text := _token_text(config.get(name))) is not None
        }
        self._add_missing_special_tokens(config)
        # transformers' encode turns off what tokenizer.json may enable (DO_NOT_TRUNCATE,
        # DO_NOT_PAD): a prompt is never cut or padded.
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = False

    def _add_missing_special_tokens(self, config: dict) -> None:
        """As transformers' constructor does: named special tokens and those of
        `added_tokens_decoder` that tokenizer.json lacks become special added tokens."""
        added = config.get("added_tokens_decoder") or {}
        extra = config.get("extra_special_tokens") or []
        extra = list(extra.values()) if isinstance(extra, dict) else list(extra)
        texts = list(self.special_tokens_map.values()) + [
            _token_text(t) for t in extra + list(added.values())
        ]
        missing = [
            t for t in dict.fromkeys(texts) if t and self.backend_tokenizer.token_to_id(t) is None
        ]
        if missing:
            self.backend_tokenizer.add_special_tokens(
                [AddedToken(t, special=True) for t in missing]
            )

    # -- special tokens ----------------------------------------------------------------------
    def _id_of(self, name: str) -> int | None:
        text = self.special_tokens_map.get(name)
        return None if text is None else self.backend_tokenizer.token_to_id(text)

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens_map.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens_map.get("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._id_of("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._id_of("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._id_of("pad_token")

    @functools.cached_property
    def added_tokens_encoder(self) -> dict[str, int]:
        """Text of every added token -> its id, in id order (as transformers gives it)."""
        decoder = self.backend_tokenizer.get_added_tokens_decoder()
        return {decoder[i].content: i for i in sorted(decoder)}

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    # -- text <-> ids ------------------------------------------------------------------------
    def encode(
        self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False
    ) -> list[int]:
        """Token ids of `text`; `split_special_tokens` encodes an added token's text as plain
        text. Not thread-safe with `split_special_tokens` (a flag on the shared backend), as
        transformers' is not: one tokenizer per thread."""
        backend = self.backend_tokenizer
        if not split_special_tokens:
            return backend.encode(text, add_special_tokens=add_special_tokens).ids
        backend.encode_special_tokens = True
        try:
            return backend.encode(text, add_special_tokens=add_special_tokens).ids
        finally:
            backend.encode_special_tokens = False

    def decode(self, token_ids: int | list[int], skip_special_tokens: bool = False) -> str:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        return self.backend_tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    # -- chat --------------------------------------------------------------------------------
    def apply_chat_template(
        self,
        conversation: list[dict],
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        **kwargs,
    ) -> str | list[int]:
        """The conversation rendered with the model's chat template, as transformers renders it
        (its jinja2 sandbox, filters and globals; the special tokens as variables), or with
        `chat_template`; token ids when `tokenize` (encoded without added BOS/EOS, as
        transformers does)."""
        template = chat_template or self._template(tools)
        variables = {**self.special_tokens_map, **kwargs}
        text = _compile(template).render(
            messages=_plain(conversation), tools=_plain(tools), documents=_plain(documents),
            add_generation_prompt=add_generation_prompt, **_plain(variables),
        )  # fmt: skip
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _template(self, tools) -> str:
        template = self.chat_template
        if isinstance(template, dict):
            name = "tool_use" if tools is not None and "tool_use" in template else "default"
            template = template.get(name)
        if template is None:
            raise ValueError("this tokenizer has no chat template")
        return template


def _plain(value: Any) -> Any:
    """Only JSON types reach the template (the sandbox does not know other objects' methods):
    as transformers does, a subclass of str/int/float (an enum, ...) becomes its base type."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (str, bool, int, float):
        if isinstance(value, base):
            return base(value) if base is not str else str.__str__(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_plain(v) for v in value)
    raise TypeError(f"chat template inputs must be JSON data, not {type(value).__name__}")


@functools.lru_cache(maxsize=16)
def _compile(template: str):
    """transformers' chat-template environment: the immutable sandbox, trim/lstrip blocks,
    loop controls, `{% generation %}` blocks (rendered as their body), `tojson` without HTML
    escaping, `raise_exception`, `strftime_now`, and a `namespace` that refuses underscore
    names (no way to CPython internals)."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):  # jinja's signature trick: `namespace(self=...)` works
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} refused")

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["namespace"] = Namespace
    return env.from_string(template)
