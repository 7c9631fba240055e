"""Phi-3: the Llama decoder with its q/k/v and gate/up projections stored fused in the
checkpoint (`qkv_proj`, `gate_up_proj`: the names of our own fused layers, so the loader splits
them shard by shard, engine/loader.py) and no biases.

Long-rope ("longrope", Phi-3 128k) comes from HF's rope functions (engine/layers/rotary.py),
which pick the short or the long factors from the longest position in a step. HF's `generate`
also does that, and in addition recomputes the whole cache once a sequence first grows past
`original_max_position_embeddings`; the engine does not, so output equals HF's for sequences
that stay within that length or whose prompt already exceeds it, prefilled in one chunk.
"""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    packed_modules_mapping: dict[str, tuple[str, str]] = {}  # fused already in the checkpoint

    @staticmethod
    def attention_biases(hf_config) -> tuple[bool, bool]:
        return False, False
