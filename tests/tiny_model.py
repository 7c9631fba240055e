"""Tiny random Llama checkpoints for fast tests: a real HF checkpoint directory (config,
safetensors, tokenizer), small enough that a forward pass takes milliseconds."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import ByteLevelBPETokenizer
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Kafka streams prompts to workers; workers stream tokens back.",
    "Paged attention keeps the KV cache in fixed-size blocks.",
    "Ünïcödé text, emoji 🚀🔥 and CJK 漢字かな are byte-level encoded.",
    "def f(x):\n    return x * 2  # code too",
] * 20


def make_tokenizer(vocab_size: int = 384) -> PreTrainedTokenizerFast:
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        _CORPUS,
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        show_progress=False,
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_tiny_llama(
    path: Path,
    *,
    seed: int = 0,
    vocab_size: int = 384,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = True,
    **config_overrides,
) -> Path:
    """Write a random Llama checkpoint + tokenizer to `path` and return it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(vocab_size)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **config_overrides,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    # Random init gives near-uniform logits; sharpen them so greedy argmax is far from ties.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
