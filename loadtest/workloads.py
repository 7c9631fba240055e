"""The workloads every benchmark shares, defined once.

- W1: one chat request, 128 new tokens (the latency a person feels).
- W2: 32 distinct chat prompts submitted together, 128 new tokens each (a busy worker).
All greedy, EOS ignored, so every run generates exactly the same number of tokens.
"""

from __future__ import annotations

W1_NUM_REQUESTS = 1
W2_NUM_REQUESTS = 32
DEFAULT_MAX_TOKENS = 128

TOPICS = [
    "the water cycle",
    "black holes",
    "how vaccines work",
    "the history of Rome",
    "photosynthesis",
    "machine learning",
    "the French revolution",
    "volcanoes",
    "the stock market",
    "climate change",
    "the human heart",
    "quantum computing",
    "honey bees",
    "the Silk Road",
    "electric cars",
    "the moon landing",
    "coral reefs",
    "the printing press",
    "earthquakes",
    "the immune system",
    "renewable energy",
    "ancient Egypt",
    "the internet",
    "rainforests",
    "the theory of evolution",
    "jazz music",
    "the Olympic games",
    "DNA",
    "the Great Wall of China",
    "recycling",
    "the solar system",
    "chess",
]


def chat_messages(i: int) -> list[dict]:
    """The i-th W2 conversation (32 distinct topics)."""
    return [{"role": "user", "content": f"Explain {TOPICS[i % len(TOPICS)]} to a curious child."}]


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    return [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                chat_messages(i), add_generation_prompt=True, tokenize=False
            )
        )
        for i in range(n)
    ]


# Engine options of every benchmark run (the e2e benchmark gives its worker the same ones).
ENGINE_OPTIONS = {"max_num_seqs": 64, "max_num_batched_tokens": 2048}
