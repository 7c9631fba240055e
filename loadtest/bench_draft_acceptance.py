"""How often a quantized copy of the model picks the bf16 model's greedy token: the acceptance a
self-speculative draft would see, and what it would buy a bytes-bound W1 bf16 step.

    python -m loadtest.bench_draft_acceptance [--draft int4] [--max-tokens 128] [--out r.json]

The bf16 engine generates greedy continuations of a few chat prompts; the draft engine (`--draft`
quantization of the same checkpoint) reads each prompt + continuation with `prompt_logprobs=1`,
and at every generated position its top-1 is compared with the bf16 token there (teacher
forcing: the draft sees the bf16 prefix, as a speculative draft would after each verified
round). From the per-position agreement it prints, for drafts of k tokens, the tokens one bf16
verification pass would yield (the longest agreeing prefix, plus the verifier's own token).
This measures the lever, not a decoder: the engine has no speculative decoding.
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path

from loadtest.report import emit

PROMPTS = (
    "Write a short story about a dragon who learns to cook.",
    "Explain how a refrigerator works, step by step.",
    "What are the main causes of the French Revolution?",
    "Give me a recipe for pancakes.",
    "Describe the water cycle to a ten-year-old.",
)


def tokens_per_pass(hits: list[list[bool]], k: int) -> float:
    """Tokens a bf16 pass verifies, on average, for drafts of k tokens: each round accepts the
    drafted tokens up to the first disagreement and adds the verifier's own next token."""
    passes = tokens = 0
    for stream in hits:
        i = 0
        while i < len(stream):
            accepted = 0
            while accepted < k and i + accepted < len(stream) and stream[i + accepted]:
                accepted += 1
            tokens += min(accepted + 1, len(stream) - i)
            passes += 1
            i += accepted + 1
    return tokens / max(passes, 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--draft", default="int4", help="the draft's quantization")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    from engine import LLM, SamplingParams

    target = LLM(args.model, quantization=None)
    tokenizer = target.tokenizer
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True
        )
        for p in PROMPTS
    ]
    outputs = target.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0.0))
    streams = [(list(o.prompt_token_ids), list(o.token_ids)) for o in outputs]
    del target
    gc.collect()

    draft = LLM(args.model, quantization=args.draft)
    hits: list[list[bool]] = []
    for prompt, generated in streams:
        [out] = draft.generate(
            [prompt + generated], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
        )
        row = []
        for i, token in enumerate(generated):
            entry = out.prompt_logprobs[len(prompt) + i]
            top = max(entry.items(), key=lambda item: item[1].logprob)[0]
            row.append(top == token)
        hits.append(row)
    agree, total = sum(map(sum, hits)), sum(map(len, hits))
    doc = {
        "model": args.model,
        "draft": args.draft,
        "prompts": len(PROMPTS),
        "generated_tokens": total,
        "agreement": round(agree / max(total, 1), 4),
        "tokens_per_bf16_pass": {k: round(tokens_per_pass(hits, k), 2) for k in range(1, 9)},
    }
    print(f"{args.draft} top-1 == bf16 greedy: {agree} / {total} ({doc['agreement']:.1%})")
    print("draft tokens k   tokens per bf16 pass")
    for k, value in doc["tokens_per_bf16_pass"].items():
        print(f"{k:>14}   {value:.2f}")
    emit(doc, args.out, None, None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
