"""The workloads every benchmark shares, defined once.

- W1: one chat request, 128 new tokens (the latency a person feels).
- W2: 32 distinct chat prompts submitted together, 128 new tokens each (a busy worker).
- W3: 64 distinct chat prompts together, 128 new tokens each (a saturated worker).
- W4: 64 distinct prompts together, output lengths spread evenly over 16..256 (requests leave
  the batch at different steps: continuous batching against a static batch's padding).
- P1: one chat request whose prompt is a 1024-token document to summarize, 16 new tokens (the
  wait before the first token of a long prompt: prefill's speed, in prompt tokens a second).
- P4: the same with a 4096-token document (prefilled in chunks: the later ones attend to the
  cached ones, and attention's share of the work grows with the length).
All greedy, EOS ignored, so every run generates exactly the same number of tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

W1_NUM_REQUESTS = 1
W2_NUM_REQUESTS = 32
DEFAULT_MAX_TOKENS = 128
PREFILL_PROMPT_TOKENS = 1024
PREFILL_NEW_TOKENS = 16
LONG_PREFILL_PROMPT_TOKENS = 4096


@dataclass(frozen=True)
class Workload:
    name: str
    max_tokens: tuple[int, ...]  # one per request; len() is the number of requests
    # 0: the chat prompts (chat_prompts); else each request's prompt is a document of exactly
    # this many tokens (document_prompts), and the workload measures the prefill.
    prompt_tokens: int = 0

    @property
    def num_requests(self) -> int:
        return len(self.max_tokens)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_tokens)


def spread(n: int, low: int, high: int) -> tuple[int, ...]:
    """n output lengths spread evenly over [low, high], both ends included."""
    if n == 1:
        return (low,)
    return tuple(low + round(i * (high - low) / (n - 1)) for i in range(n))


def workloads(max_tokens: int = DEFAULT_MAX_TOKENS) -> dict[str, Workload]:
    """W1..W4; `max_tokens` scales W1-W3 (W4 keeps its 16..256 spread)."""
    return {
        "W1": Workload("W1", (max_tokens,) * W1_NUM_REQUESTS),
        "W2": Workload("W2", (max_tokens,) * W2_NUM_REQUESTS),
        "W3": Workload("W3", (max_tokens,) * 64),
        "W4": Workload("W4", spread(64, 16, 256)),
        "C8": Workload("C8", (max_tokens,) * 8),  # fills the concurrency plot between W1 and W2
        "P1": Workload("P1", (PREFILL_NEW_TOKENS,), prompt_tokens=PREFILL_PROMPT_TOKENS),
        "P4": Workload("P4", (PREFILL_NEW_TOKENS,), prompt_tokens=LONG_PREFILL_PROMPT_TOKENS),
    }


# Concurrency of the uniform workloads: the x axis of the throughput plot.
CONCURRENCY = {"W1": 1, "C8": 8, "W2": 32, "W3": 64}

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


AUDIENCES = ["child", "teenager", "grandparent", "student"]


def chat_messages(i: int) -> list[dict]:
    """The i-th conversation: 32 topics, then the same topics for another audience, so up to
    128 prompts are distinct (no shared prefix past the chat template)."""
    topic = TOPICS[i % len(TOPICS)]
    audience = AUDIENCES[(i // len(TOPICS)) % len(AUDIENCES)]
    return [{"role": "user", "content": f"Explain {topic} to a curious {audience}."}]


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    return [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                chat_messages(i), add_generation_prompt=True, tokenize=False
            )
        )
        for i in range(n)
    ]


def document_prompts(tokenizer, n: int, num_tokens: int) -> list[list[int]]:
    """n chat prompts of exactly `num_tokens` tokens: a request to summarize notes (sentences
    over the topics, each prompt's starting at a topic of its own, so two prompts part within
    the first note: no full KV block in common past the chat template's), the notes cut to
    fit. The template's head and tail (the same for every prompt) are encoded apart from the
    notes, so the cut never splits the template."""
    marker = "\x00NOTES\x00"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Summarize these notes in one sentence.\n\n{marker}"}],
        add_generation_prompt=True, tokenize=False,
    )  # fmt: skip
    head, tail = (tokenizer.encode(part) for part in text.split(marker))
    room = num_tokens - len(head) - len(tail)
    if room <= 0:
        raise ValueError(f"{num_tokens} tokens leave no room for notes after the template")
    prompts = []
    for i in range(n):
        notes: list[int] = []
        k = 0
        while len(notes) < room:
            topic = TOPICS[(i + k) % len(TOPICS)]
            audience = AUDIENCES[(i + k // len(TOPICS)) % len(AUDIENCES)]
            notes += tokenizer.encode(
                f"Note {k + 1}: explain {topic} to a curious {audience}, in plain words.\n"
            )
            k += 1
        prompts.append(head + notes[:room] + tail)
    return prompts


def workload_prompts(tokenizer, workload: Workload) -> list[list[int]]:
    """The prompts of `workload`: the chat prompts, or its documents (`prompt_tokens`)."""
    if workload.prompt_tokens:
        return document_prompts(tokenizer, workload.num_requests, workload.prompt_tokens)
    return chat_prompts(tokenizer, workload.num_requests)


# Engine options of every benchmark run (the e2e benchmark gives its worker the same ones).
ENGINE_OPTIONS = {"max_num_seqs": 64, "max_num_batched_tokens": 2048}
