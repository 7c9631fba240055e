"""The benchmark's workloads: the prefill workload's prompts, and how bench engine compares it
(prompt tokens a second to the first token) beside the decode workloads (output tokens a
second)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadtest.bench_engine import _decode_medians, _medians, prefill_speed, speed_of
from loadtest.workloads import document_prompts, workload_prompts, workloads


class _Tokenizer:
    """A word-level stand-in for the chat tokenizer: one id per whitespace-separated word."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and not tokenize
        return f"<user> {messages[0]['content']} <end> <assistant> "

    def encode(self, text: str) -> list[int]:
        return [self.ids.setdefault(word, len(self.ids)) for word in text.split()]


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 5), num_tokens=st.integers(12, 600))
def test_document_prompts_have_the_length_asked_and_share_no_prefix_past_the_template(
    n, num_tokens
) -> None:
    tokenizer = _Tokenizer()
    prompts = document_prompts(tokenizer, n, num_tokens)
    head = tokenizer.encode("<user> Summarize these notes in one sentence.")
    tail = tokenizer.encode("<end> <assistant>")
    assert [len(p) for p in prompts] == [num_tokens] * n
    for p in prompts:
        assert p[: len(head)] == head and p[-len(tail) :] == tail  # the template is never cut
    # Past the template's head, every two prompts part within their first note's words.
    if num_tokens - len(head) - len(tail) >= 8:
        starts = [tuple(p[len(head) : len(head) + 8]) for p in prompts]
        assert len(set(starts)) == n


def test_a_length_the_template_fills_is_an_error() -> None:
    with pytest.raises(ValueError, match="no room"):
        document_prompts(_Tokenizer(), 1, 5)


def test_p1_takes_documents_and_the_others_the_chat_prompts() -> None:
    tokenizer = _Tokenizer()
    p1, p4, w1 = workloads()["P1"], workloads()["P4"], workloads()["W1"]
    assert [len(p) for p in workload_prompts(tokenizer, p1)] == [p1.prompt_tokens]
    assert [len(p) for p in workload_prompts(tokenizer, p4)] == [4096]
    assert len(workload_prompts(_ChatOnly(), w1)) == 1


class _ChatOnly(_Tokenizer):
    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert "Summarize" not in messages[0]["content"]  # W1 is a chat prompt, not a document
        return super().apply_chat_template(messages, add_generation_prompt, tokenize)


def test_prefill_speed_is_the_prompts_over_the_last_first_token() -> None:
    result = {"ttfts_ms": [100.0, 400.0]}
    assert prefill_speed([[1] * 300, [1] * 500], result) == {
        "prompt_tokens": 800,
        "prompt_tokens_per_s": 2000.0,
    }


def test_the_table_compares_p1_by_prompt_speed_and_the_rest_by_output_speed() -> None:
    assert speed_of("P1") == "prompt_tokens_per_s" and speed_of("W1") == "tokens_per_s"
    runs = [
        {"results": {"W1": {"tokens_per_s": 10.0, "prompt_tokens_per_s": 999.0},
                     "P1": {"tokens_per_s": 1.0, "prompt_tokens_per_s": p}}}  # fmt: skip
        for p in (700.0, 900.0, 800.0)
    ]
    assert _medians(runs, ["W1", "P1"]) == {"W1": 10.0, "P1": 800.0}


def test_bench_engine_compares_one_requests_decode_against_llamacpps_own_clock():
    def rounds(*results):
        return [{"results": {"W1": r}} for r in results]

    engine = {"output_tokens": 128, "elapsed_s": 0.6, "ttfts_ms": [70.0]}
    peer = {"output_tokens": 128, "elapsed_s": 1.3, "ttfts_ms": [200.0],
            "server_tok_s": {"median": 120.0, "sum": 120.0}}  # fmt: skip
    batch = {"output_tokens": 256, "elapsed_s": 0.6, "ttfts_ms": [70.0, 80.0]}
    runs = {"engine-bfloat16-int4": rounds(engine, engine), "llamacpp-gguf": rounds(peer, peer),
            "engine-bfloat16-int8": rounds(batch, batch)}  # fmt: skip
    medians, ratios = _decode_medians(runs, ["W1"])
    assert medians == {"engine-bfloat16-int4": {"W1": 239.6}, "llamacpp-gguf": {"W1": 120.0}}
    assert ratios == {"engine-bfloat16-int4/llamacpp-gguf": {"W1": 2.0}}
