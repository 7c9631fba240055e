"""Structured output end to end on the tiny random model: whatever the (random) model prefers,
the output follows the grammar.

The JSON schemas are generated with a bounded language: every string has a maxLength, every
integer bounds, every array maxItems. So each schema has a longest valid output of L bytes,
and since every token the mask allows is at least one byte, a request with max_tokens = L + 1
must end on its own: the assertion is "finished with `stop`, parses, validates", with no
allowance for a length cut.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams
from engine.sampling_params import StructuredOutput

PROMPTS = ["The quick brown fox", "Kafka streams prompts", "def f(x):"]
NAMES = ["id", "name", "tags", "ok", "n", "child"]
# The longest JSON text of one character of a string: a surrogate pair escaped, \ud83d\ude80.
MAX_BYTES_PER_CHAR = 12


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="float32", max_num_seqs=8)


def leaf_schemas():
    integers = st.tuples(st.integers(-500, 500), st.integers(0, 500)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}
    )
    strings = st.integers(0, 6).map(lambda n: {"type": "string", "maxLength": n})
    enums = st.lists(
        st.text("abcxyz -", min_size=1, max_size=5), min_size=1, max_size=3, unique=True
    )
    return st.one_of(
        integers, strings, st.just({"type": "boolean"}), st.just({"type": "null"}),
        enums.map(lambda values: {"enum": values}),
    )  # fmt: skip


def _extend(children):
    arrays = st.tuples(children, st.integers(0, 2), st.integers(0, 2)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]}
    )
    objects = st.dictionaries(st.sampled_from(NAMES), children, min_size=1, max_size=3).flatmap(
        lambda props: st.sets(st.sampled_from(sorted(props))).map(
            lambda required: {"type": "object", "properties": props, "required": sorted(required)}
        )
    )
    return st.one_of(arrays, objects)


def root_schemas():
    children = st.recursive(leaf_schemas(), _extend, max_leaves=4)
    return st.dictionaries(st.sampled_from(NAMES), children, min_size=1, max_size=3).map(
        lambda props: {"type": "object", "properties": props, "required": sorted(props)}
    )


def max_json_bytes(schema: dict) -> int:
    """An upper bound on the UTF-8 length of any compact JSON text valid for `schema`."""
    if "enum" in schema:
        return max(len(json.dumps(v).encode()) * 6 for v in schema["enum"])
    kind = schema["type"]
    if kind == "integer":
        return max(len(str(schema["minimum"])), len(str(schema["maximum"])))
    if kind == "string":
        return 2 + MAX_BYTES_PER_CHAR * schema["maxLength"]
    if kind in ("boolean", "null"):
        return 5
    if kind == "array":
        return 2 + schema["maxItems"] * (max_json_bytes(schema["items"]) + 2)
    return 2 + sum(  # object: '"name": value, ' per property, escaped names at most 6x
        6 * len(name) + 6 + max_json_bytes(child) for name, child in schema["properties"].items()
    )


@settings(
    max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(schema=root_schemas(), temperature=st.sampled_from([0.0, 0.7, 1.5]), seed=st.integers(0, 99))
# Found by hypothesis: the tiny model spelt a UTF-16 surrogate (ED B2 80) byte by byte inside a
# maxLength-2 string, which xgrammar's own string rule allowed (engine/structured/grammars.py).
@example(
    schema={
        "type": "object",
        "properties": {
            "n": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
            "ok": {"type": "string", "maxLength": 2},
        },
        "required": ["n", "ok"],
    },
    temperature=0.7,
    seed=91,
)
def test_generated_schemas_validate(llm, schema, temperature, seed):
    structured = StructuredOutput("json_schema", json.dumps(schema))
    max_tokens = max_json_bytes(schema) + 1  # + the stop token
    params = [
        SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed + i,
            structured_output=structured,
        )  # fmt: skip
        for i in range(len(PROMPTS))
    ]
    for output in llm.generate(PROMPTS, params):  # a batch: each request its own matcher
        assert output.finish_reason == "stop", (output.text, schema)
        jsonschema.validate(json.loads(output.text), schema)


def test_json_object_regex_and_choice(llm):
    pattern = r"[a-z]{2,5}@[0-9]{3}(\.[a-z]{2})?"
    choices = ["red", "green", 'blue "sky"', "漢字"]
    specs = [
        (StructuredOutput("regex", pattern), lambda text: re.fullmatch(pattern, text)),
        (StructuredOutput("choice", choices), lambda text: text in choices),
    ]
    for structured, check in specs:
        outputs = llm.generate(
            PROMPTS,
            [SamplingParams(max_tokens=40, temperature=1.0, seed=i, structured_output=structured)
             for i in range(len(PROMPTS))],
        )  # fmt: skip
        for output in outputs:
            assert output.finish_reason == "stop" and check(output.text), output.text
    # JSON mode has no length bound: assert the valid-prefix property and that a finished one
    # is an object.
    outputs = llm.generate(
        PROMPTS,
        SamplingParams(
            max_tokens=30, temperature=0.0, structured_output=StructuredOutput("json_object")
        ),
    )
    for output in outputs:
        assert output.text.startswith("{")
        if output.finish_reason == "stop":
            assert isinstance(json.loads(output.text), dict)


def test_invalid_specs_are_value_errors_and_leave_nothing_behind(llm):
    engine = llm.engine
    for structured in [
        StructuredOutput("json_schema", '{"type": "nonsense"}'),
        StructuredOutput("json_schema", "not json"),
        StructuredOutput("json_schema", "[1, 2]"),
        StructuredOutput("regex", "(unclosed"),
    ]:
        with pytest.raises(ValueError, match=f"invalid {structured.type}"):
            engine.add_request("bad", "hello", SamplingParams(structured_output=structured))
        assert "bad" not in engine.scheduler.requests
    with pytest.raises(ValueError, match="logit_bias token id"):
        engine.add_request("bad", "hello", SamplingParams(logit_bias={engine.vocab_size: 1.0}))


def test_grammars_are_compiled_once_per_spec(llm):
    structured = StructuredOutput("regex", "[0-9]{4}")
    llm.generate(PROMPTS[0], SamplingParams(max_tokens=6, structured_output=structured))
    num_cached = llm.engine._grammars.num_cached
    llm.generate(PROMPTS, SamplingParams(max_tokens=6, structured_output=structured))
    assert llm.engine._grammars.num_cached == num_cached


def test_preemption_and_stop_strings_keep_the_grammar(tiny_model_dir):
    """A KV cache too small for the batch forces preemption (recompute): every request still
    follows its grammar, and greedy outputs equal those of an unpressured engine."""
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "n": {"type": "integer", "minimum": 0, "maximum": 999},
        },
        "required": ["name", "n"],
    }
    structured = StructuredOutput("json_schema", json.dumps(schema))
    params = SamplingParams(max_tokens=80, temperature=0.0, structured_output=structured)
    prompts = [f"{p} {i}" for i in range(3) for p in PROMPTS]
    roomy = LLM(str(tiny_model_dir), dtype="float32", max_num_seqs=9)
    expected = [o.text for o in roomy.generate(prompts, params)]
    # 40 blocks of 4 tokens: nine requests of up to ~60 tokens cannot all stay resident.
    tight = LLM(
        str(tiny_model_dir), dtype="float32", max_num_seqs=9, block_size=4, num_kv_blocks=40,
        max_num_batched_tokens=32,
    )  # fmt: skip
    outputs = tight.generate(prompts, params)
    assert tight.get_stats().num_preemptions > 0
    assert [o.text for o in outputs] == expected
    for output in outputs:
        jsonschema.validate(json.loads(output.text), schema)
    # A stop string cuts the text (the grammar does not undo it) and ends the request.
    cut = roomy.generate(prompts[0], SamplingParams(
        max_tokens=80, temperature=0.0, structured_output=structured, stop=['"n"'],
    ))[0]  # fmt: skip
    assert (
        cut.finish_reason == "stop" and expected[0].startswith(cut.text) and '"n"' not in cut.text
    )


REAL_MODEL_SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
            "email": {"type": "string", "maxLength": 60},
        },
        "required": ["name", "age", "email"],
    },
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 40},
            "country": {"type": "string", "maxLength": 40},
            "population_millions": {"type": "number", "minimum": 0, "maximum": 100},
            "is_capital": {"type": "boolean"},
        },
        "required": ["city", "country", "is_capital"],
    },
    {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 60},
            "tags": {
                "type": "array",
                "items": {"enum": ["news", "sports", "tech", "science"]},
                "maxItems": 3,
            },
            "sentiment": {"enum": ["positive", "neutral", "negative"]},
        },
        "required": ["title", "tags", "sentiment"],
    },
]
REAL_MODEL_ASKS = [
    "Describe a fictional person as JSON with name, age and email.",
    "Give me facts about Paris as JSON.",
    "Summarise this headline as JSON: 'New telescope finds water on a distant planet'.",
]


@pytest.mark.real_model
def test_real_model_outputs_validate():
    llm = LLM("smollm2-135m")  # the default (fast) path: what `serve` runs
    tok = llm.tokenizer
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": ask}], add_generation_prompt=True, tokenize=False
        )
        for ask in REAL_MODEL_ASKS
    ]
    for temperature in (0.0, 0.8):
        params = [
            SamplingParams(
                max_tokens=300,
                temperature=temperature,
                seed=7,
                structured_output=StructuredOutput("json_schema", json.dumps(schema)),
            )  # fmt: skip
            for schema in REAL_MODEL_SCHEMAS
        ]
        outputs = llm.generate(prompts, params)
        for output, schema in zip(outputs, REAL_MODEL_SCHEMAS, strict=True):
            assert output.finish_reason == "stop", output.text
            jsonschema.validate(json.loads(output.text), schema)
    sentiment = llm.generate(
        prompts[2],
        SamplingParams(
            max_tokens=8,
            temperature=0.0,
            structured_output=StructuredOutput("choice", ["positive", "negative"]),
        ),
    )[0]
    assert sentiment.text in ("positive", "negative") and sentiment.finish_reason == "stop"
