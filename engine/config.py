"""Engine configuration: one frozen dataclass, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass, fields

from engine.attention_backends import REQUESTABLE


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs. Every field has a default that works on a laptop CPU.

    The KV-cache pool holds what the configured sequences can use (`max_num_seqs` sequences of
    `max_model_len` tokens), capped by `kv_cache_memory_bytes`, unless `num_kv_blocks` pins it
    (tests use a handful of blocks to force preemption); its pages are committed as they are
    first written.
    """

    block_size: int = 16
    kv_cache_memory_bytes: int = 512 * 1024 * 1024
    num_kv_blocks: int | None = None
    # False: the pool's pages are committed as blocks are first written (RSS follows load).
    # True: all at start-up (0.7 s for 512 MiB here): no first-touch stalls mid-step (~5 ms per
    # fresh 2 MiB page measured in a VM), and a pool that does not fit fails at once, not later.
    kv_cache_prefault: bool = False
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None  # None: the model's max_position_embeddings, capped at 8192
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    seed: int = 0  # seeds requests that give no seed of their own
    # "auto" | "torch" | "cpu" | "triton"; resolved with the device and KV cache dtype in
    # engine/attention_backends.py ("auto": the C++ kernels on CPU, Triton on CUDA)
    attention_backend: str = "auto"
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's default
    # "auto": per shape, plain F.linear, oneDNN-packed weights or (bf16) our GEMV, whichever a
    # calibration on this machine found faster (cached under the cache dir); "plain" | "packed"
    # | "gemv" force one path (falling back to the next this machine runs).
    linear_kernel: str = "auto"
    # The CPU step's elementwise chains (add + RMSNorm, RoPE, SiLU * up): "auto" | "on" use the
    # fused C++ ops (engine/kernels/cpu/fused_ops.py; the torch chain where they cannot be
    # built), "off" the torch chain. Same bits either way; eager only (compiled: Inductor's).
    fused_ops: str = "auto"
    # A decode-only step as one C++ call, one parallel region (engine/fused_decode.py):
    # "auto" | "on" where the model and step allow (Llama-family, bf16 compute, int4/int8 weights
    # or bf16 ones on our GEMV, the bf16 or int8 KV cache, fused ops on), "off" the
    # per-operator path. Same bits either way.
    fused_decode: str = "auto"
    # Speculative decoding in the fused step (engine/fused_decode.py `speculate`): a
    # request decoding alone gets tokens proposed, verified in one step of consecutive rows;
    # the tokens are the ones one-token steps give. The request's own tokens propose first
    # (prompt lookup, engine/ngram_lookup.py: up to 3 with int4/int8 weights, 2 with bf16; no
    # memory); where they have nothing, with bf16 projections on our GEMV and the lm_head's int8
    # screen, a draft on int4 copies of the layers proposes 2 (SmolLM2-135M in bf16: +66 MB of
    # draft weights). Sampled requests take the lookup's proposals, each verified row drawn as
    # a one-token step draws it (the same tokens for a seed). With int4/int8 weights, 2 or 3
    # requests decoding together (greedy or sampled) verify their lookup proposals in one step
    # (`speculate_batch`: the tokens of the same requests' one-token steps while the batch
    # holds). "auto" | "on" where the step allows, "off" never.
    speculative_decoding: str = "auto"
    # torch.compile of the model forward: "on" | "off" | "auto" (True/False mean on/off). "auto"
    # is off: on the 2-core Zen 4 the compiled step did not beat eager (engine/compile.py).
    compile: str | bool = "auto"
    # "auto": CUDA when torch sees a GPU, else the CPU; "cuda" runs CudaModelRunner (Triton
    # kernels, CUDA-graph decode), "cpu" the CPU runner.
    device: str = "auto"
    cuda_graphs: bool = True  # only on CUDA: capture the decode step for bucketed batch sizes
    kv_cache_dtype: str = "auto"  # "auto" (the model dtype) | "int8" (engine/quant/kv_int8.py)
    # Steps sized by urgency (engine/scheduler.py): while a request with priority <=
    # `urgent_priority` is in the engine, a step's tokens are capped to stay under this many ms
    # by a step cost model calibrated at start-up. None or 0: the token budget only. Off by default
    # in the engine (whose default priority, 0, would make all work urgent); the worker, where
    # priority is the request's urgency (critical 0, high 1), sets 100 ms.
    step_time_target_ms: float | None = None
    urgent_priority: int = 1
    # With nothing urgent in the engine, a step's prefill chunks still stay under this many ms
    # (same cost model; decodes are never cut and spend none of it): the engine takes new
    # requests only between steps, so a critical request that arrives during a step waits for
    # it. Uncapped, 24 low 64-token prompts made one 10 s prefill step on the 2-core machine.
    # None or 0: the token budget only. The worker sets 500 ms: a step's fixed cost (~17 ms
    # there) is then ~3% of a capped prefill step.
    max_step_time_ms: float | None = None

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_bytes < 1:
            raise ValueError("kv_cache_memory_bytes must be positive")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be >= 1")
        if self.attention_backend not in REQUESTABLE:  # the rest: engine/attention_backends.py
            raise ValueError(
                f"attention_backend must be one of {', '.join(REQUESTABLE)}, "
                f"got {self.attention_backend!r}"
            )

        compile_mode = {True: "on", False: "off"}.get(self.compile, self.compile)
        if not isinstance(compile_mode, str) or compile_mode.lower() not in ("auto", "on", "off"):
            raise ValueError(f"compile must be 'auto', 'on', 'off' or a bool, got {self.compile!r}")
        object.__setattr__(self, "compile", compile_mode.lower())
        if self.linear_kernel not in ("auto", "plain", "packed", "gemv"):
            raise ValueError(
                "linear_kernel must be 'auto', 'plain', 'packed' or 'gemv', "
                f"got {self.linear_kernel!r}"
            )

        if self.step_time_target_ms == 0:  # 0 means off too (an env variable cannot say None)
            object.__setattr__(self, "step_time_target_ms", None)
        if self.step_time_target_ms is not None and not self.step_time_target_ms > 0:
            raise ValueError(f"step_time_target_ms must be > 0, got {self.step_time_target_ms}")
        if self.max_step_time_ms == 0:
            object.__setattr__(self, "max_step_time_ms", None)
        if self.max_step_time_ms is not None and not self.max_step_time_ms > 0:
            raise ValueError(f"max_step_time_ms must be > 0, got {self.max_step_time_ms}")
        if self.fused_ops not in ("auto", "on", "off"):
            raise ValueError(f"fused_ops must be 'auto', 'on' or 'off', got {self.fused_ops!r}")
        if self.fused_decode not in ("auto", "on", "off"):
            raise ValueError(
                f"fused_decode must be 'auto', 'on' or 'off', got {self.fused_decode!r}"
            )
        if self.speculative_decoding not in ("auto", "on", "off"):
            raise ValueError(
                "speculative_decoding must be 'auto', 'on' or 'off', "
                f"got {self.speculative_decoding!r}"
            )
        if self.kv_cache_dtype not in ("auto", "int8"):
            raise ValueError(
                f"kv_cache_dtype must be 'auto' or 'int8', got {self.kv_cache_dtype!r}"
            )

    @property
    def has_step_cost(self) -> bool:
        """Whether steps are sized by time at all (and so need the step cost model)."""
        return self.step_time_target_ms is not None or self.max_step_time_ms is not None

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(
                f"unknown engine option(s): {', '.join(unknown)}; known: {sorted(known)}"
            )
        return cls(**kwargs)
