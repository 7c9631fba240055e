"""A tied embedding looked up in the int8 lm_head's codes (engine/quant/embedding.py): the
rows are the head's dequantized rows whatever layout holds the codes, the float table is gone,
and the model's outputs stay those of the float table within the quantization error."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams
from engine.quant.config import QuantConfig
from engine.quant.embedding import HeadEmbedding
from engine.quant.linear import QuantLinear
from tests.tiny_model import make_tiny_llama


def _head(kernel: str, out_features: int = 53, in_features: int = 64) -> QuantLinear:
    head = QuantLinear(
        in_features, out_features, False, torch.bfloat16, QuantConfig("int8", kernel=kernel)
    )
    torch.manual_seed(0)
    head.weight_loader(head.weight, torch.randn(out_features, in_features), None)
    return head


@pytest.mark.parametrize("kernel", ["auto", "torch"])
@settings(max_examples=20, deadline=None)
@given(ids=st.lists(st.integers(0, 52), min_size=1, max_size=12))
def test_rows_are_the_dequantized_rows_in_every_layout(kernel, ids):
    head = _head(kernel)
    expected = head.dequantized_weight()[ids]
    index = torch.tensor(ids)
    assert torch.equal(head.dequantized_rows(index), expected)  # canonical codes
    head.pack()
    assert torch.equal(head.dequantized_rows(index), expected)  # the kernel's or torch's layout


def test_int4_codes_refuse_row_lookup():
    head = QuantLinear(64, 16, False, torch.bfloat16, QuantConfig("int4"))
    with pytest.raises(ValueError, match="int8"):
        head.dequantized_rows(torch.tensor([0]))


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "auto"])
def test_tied_quantized_model_uses_the_head_codes(tiny_model_dir, kv_cache_dtype):
    options = {"dtype": "bfloat16", "fused_decode": "off", "kv_cache_dtype": kv_cache_dtype}
    llm = LLM(str(tiny_model_dir), quantization="int8", **options)
    runner = llm.engine.runner
    assert runner.embedding == "head_codes"
    embedding = runner.model.model.embed_tokens
    assert isinstance(embedding, HeadEmbedding)
    assert not any("embed_tokens" in name for name, _ in runner.model.named_parameters())
    ids = torch.tensor([[0, 5, 5], [len(llm.tokenizer) - 1, 1, 2]])
    rows = embedding(ids)
    assert rows.shape == (2, 3, embedding.embedding_dim) and rows.dtype == torch.bfloat16
    assert torch.equal(rows[1, 0], runner.model.lm_head.dequantized_rows(ids[1, :1])[0].bfloat16())

    table = LLM(
        str(tiny_model_dir), quantization=QuantConfig("int8", embedding_from_head=False), **options
    )
    assert table.engine.runner.embedding == "table"
    prompt = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)
    ours, theirs = _prompt_logprobs(llm, prompt), _prompt_logprobs(table, prompt)
    # The embedding's int8 rounding only: about 1/254 of a row's largest weight.
    # Measured: a mean change of 0.1% of the mean |logprob|; rows looked up wrong move it by
    # whole nats. Not identical either: the lookup did go through the codes.
    assert (ours - theirs).abs().mean() < 0.01 * ours.abs().mean()
    assert not torch.equal(ours, theirs)


def _prompt_logprobs(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """Log-probabilities of each prompt token after the first, given those before it."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    (out,) = llm.generate([prompt], params)
    entries = zip(prompt[1:], out.prompt_logprobs[1:], strict=True)
    return torch.tensor([entry[token].logprob for token, entry in entries])


def test_float_untied_or_opted_out_models_keep_the_table(tmp_path, tiny_model_dir):
    untied = make_tiny_llama(tmp_path / "untied", tie_word_embeddings=False)
    options = {"dtype": "bfloat16", "fused_decode": "off"}
    for model, quant in [(tiny_model_dir, None), (untied, "int8"),
                         (tiny_model_dir, dataclasses.replace(QuantConfig("int4"), embedding_from_head=False))]:  # fmt: skip
        runner = LLM(str(model), quantization=quant, **options).engine.runner
        assert runner.embedding == "table"
        assert isinstance(runner.model.model.embed_tokens, torch.nn.Embedding)
