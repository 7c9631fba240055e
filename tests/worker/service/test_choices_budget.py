"""The batcher's token budget counts a request's n choices (contract v1.2 `n`)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from worker.service.pipeline import prefill_tokens


def test_prompt_once_then_a_block_per_further_choice() -> None:
    assert prefill_tokens(200, 1, 16) == 200
    assert prefill_tokens(200, 4, 16) == 200 + 3 * 16
    assert prefill_tokens(10, 3, 16) == 30  # a prompt shorter than a block: computed n times


@given(st.integers(1, 10_000), st.integers(1, 16), st.integers(1, 256))
def test_between_one_prompt_and_n_prompts(num_prompt_tokens, n, block_size) -> None:
    num_tokens = prefill_tokens(num_prompt_tokens, n, block_size)
    assert num_prompt_tokens <= num_tokens <= n * num_prompt_tokens
