"""Which attention backend a runner uses: decided here, once, from (device, KV cache dtype,
requested backend, compile).

    device  requested  float KV              int8 KV
    cpu     auto       cpu, else torch (*)   cpu-int8kv, else torch-int8kv (*)
    cpu     cpu        cpu, else error       cpu-int8kv, else error
    cpu     torch      torch                 torch-int8kv
    any     triton     triton, else error    triton (it quantizes on store itself)
    cuda    auto       triton, else error    triton, else error
    cuda    cpu        error (the C++ kernels read host memory)

"cpu" is the C++ kernels (engine/layers/cpu_attention.py) where they build on this machine;
(*) "auto" falls back to the torch reference when they do not, and says why (logged once per
runner). An explicitly requested backend that cannot run is an error at start-up, never a silent
substitute. "device" is the runner's kind: CudaModelRunner passes "cuda" even when a test runs
it on CPU tensors under the Triton interpreter.

Compiling does not change the kernels: the compiled graph reaches the chosen backend through one
custom op per layer (engine/compile.py), so every CPU row holds compiled or eager. On the CUDA
runner compiling is an error: it runs the eager model (and CUDA graphs of it), not the compiled
step that the op needs.

Models may still narrow the choice for their own needs (Gemma's sliding window and soft-cap take
the torch reference: engine/models/gemma.py), with a warning of their own.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog

log = structlog.get_logger(__name__)

REQUESTABLE = ("auto", "torch", "cpu", "triton")  # EngineConfig.attention_backend
DEVICES = ("cpu", "cuda")
KV_CACHE_DTYPES = ("auto", "int8")


@dataclass(frozen=True)
class AttentionBackendChoice:
    name: str  # "torch" | "cpu" | "triton" | "torch-int8kv" | "cpu-int8kv": the backend's .name
    reason: str  # why this one
    is_fallback: bool = False  # "auto" could not take the best backend for the device


def cpu_kernels_available() -> bool:
    """Whether the C++ paged-attention extension builds (or is built) on this machine."""
    from engine.kernels.cpu import paged_attention

    return paged_attention.load() is not None


def triton_unusable_reason() -> str | None:
    """Why the Triton kernels cannot run in this process (None: they can)."""
    from engine.kernels.triton import unusable_reason

    return unusable_reason()


def resolve_attention_backend(
    device: str, kv_cache_dtype: str, requested: str, compile: bool
) -> AttentionBackendChoice:
    """The backend for a runner on `device` ("cpu" | "cuda") with the pool in `kv_cache_dtype`
    ("auto" | "int8"), given EngineConfig.attention_backend and whether the forward is compiled.
    Raises ValueError for a combination that cannot be, RuntimeError for a backend this machine
    cannot run."""
    _check(device, kv_cache_dtype, requested)
    if compile and device == "cuda":
        # The CUDA runner calls the eager model (and captures CUDA graphs of it), whose layers
        # would hold the compiled graph's op, which runs only inside CompiledModel's step.
        raise ValueError("compile='on' runs on the CPU runner only; on CUDA use compile='off'")
    choice = _choose(device, kv_cache_dtype == "int8", requested)
    if compile:
        choice = AttentionBackendChoice(
            choice.name, f"{choice.reason}; compiled: reached through one op per layer",
            choice.is_fallback,
        )  # fmt: skip
    (log.warning if choice.is_fallback else log.info)(
        "attention.backend", backend=choice.name, requested=requested, device=device,
        kv_cache_dtype=kv_cache_dtype, reason=choice.reason,
    )  # fmt: skip
    return choice


def _check(device: str, kv_cache_dtype: str, requested: str) -> None:
    if requested not in REQUESTABLE:
        raise ValueError(
            f"unknown attention backend {requested!r}; expected one of {', '.join(REQUESTABLE)}"
        )
    if device not in DEVICES:
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be 'auto' or 'int8', got {kv_cache_dtype!r}")


def _choose(device: str, is_int8: bool, requested: str) -> AttentionBackendChoice:
    suffix = "-int8kv" if is_int8 else ""
    if requested == "torch":
        return AttentionBackendChoice("torch" + suffix, "requested: the torch reference")
    if requested == "triton" or (requested == "auto" and device == "cuda"):
        problem = triton_unusable_reason()
        if problem is not None:
            raise RuntimeError(problem)
        why = "requested" if requested == "triton" else "auto on CUDA"
        # One backend for both pools: its store quantizes and its kernels dequantize as they read.
        return AttentionBackendChoice("triton", f"{why}: the Triton kernels")
    if device == "cuda":  # requested "cpu"
        raise ValueError(
            "attention_backend='cpu' runs the C++ kernels on host memory; on CUDA use 'triton' "
            "(or 'auto', or 'torch' for the reference)"
        )
    if cpu_kernels_available():
        why = "requested" if requested == "cpu" else "auto on CPU"
        return AttentionBackendChoice("cpu" + suffix, f"{why}: the C++ kernels built here")
    if requested == "cpu":
        raise RuntimeError(
            "attention_backend='cpu' needs the C++ paged-attention kernels, which did not build "
            "on this machine (see the paged_attention build warning: a C++ compiler, g++ or "
            "$CXX, is needed); use 'auto' to fall back to the torch reference"
        )
    return AttentionBackendChoice(
        "torch" + suffix, "auto on CPU: the C++ kernels did not build here (see the build "
        "warning): the torch reference", is_fallback=True,
    )  # fmt: skip


def create_attention_backend(choice: AttentionBackendChoice):
    """The backend object for a resolved choice (`forward(q, kv, kv_cache, meta)`)."""
    if choice.name == "torch":
        from engine.layers.attention import TorchPagedAttention

        return TorchPagedAttention()
    if choice.name == "torch-int8kv":
        from engine.quant.kv_int8 import Int8PagedAttention

        return Int8PagedAttention()
    if choice.name in ("cpu", "cpu-int8kv"):
        from engine.kernels.cpu import paged_attention
        from engine.layers.cpu_attention import CpuInt8PagedAttention, CpuPagedAttention

        backend_class = CpuPagedAttention if choice.name == "cpu" else CpuInt8PagedAttention
        return backend_class(paged_attention.load())
    if choice.name == "triton":
        # Imported here: Triton is needed only when asked for (CUDA, or its CPU interpreter).
        from engine.kernels.triton.backend import TritonPagedAttention

        return TritonPagedAttention()
    raise ValueError(f"no attention backend named {choice.name!r}")


def attention_backend(device: str, kv_cache_dtype: str, requested: str, compile: bool):
    """resolve_attention_backend, then create_attention_backend: what a runner calls."""
    choice = resolve_attention_backend(device, kv_cache_dtype, requested, compile)
    return create_attention_backend(choice)
