"""Mini-Infer engine: paged KV cache, continuous batching, Llama-family models.

    from engine import LLM, SamplingParams
"""

import engine.lean_imports  # noqa: F401  (first: structlog without rich, before any import of it)
import engine.openmp  # noqa: F401  (before anything imports torch: the OpenMP policy)
from engine.config import EngineConfig
from engine.outputs import CompletionOutput, EngineStats, RequestDelta, RequestOutput
from engine.sampling_params import SamplingParams


def __getattr__(name: str):
    # LLM and LLMEngine import torch; keep `import engine` light for pure-Python users.
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)


__all__ = ["LLM", "LLMEngine", "CompletionOutput", "EngineConfig", "EngineStats", "RequestDelta", "RequestOutput", "SamplingParams"]
