"""bench_accuracy's setting names: a base setting and "+" modifiers (kv8, table)."""

import pytest

from engine.quant.config import QuantConfig
from loadtest.bench_accuracy import setting_options


def test_modifiers_add_the_int8_kv_cache_and_keep_the_table():
    assert setting_options("int4+kv8", "bfloat16") == {
        "dtype": "bfloat16", "quantization": "int4", "kv_cache_dtype": "int8",
    }  # fmt: skip
    options = setting_options("int4+kv8+table", "bfloat16")
    assert options["kv_cache_dtype"] == "int8"
    assert options["quantization"] == QuantConfig("int4", embedding_from_head=False)
    assert setting_options("int8+table", "float32")["quantization"].scheme == "int8"


@pytest.mark.parametrize("name", ["int4+fast", "fp32+table", "nope+kv8"])
def test_unknown_or_inapplicable_modifiers_are_refused(name):
    with pytest.raises(ValueError):
        setting_options(name, "bfloat16")
