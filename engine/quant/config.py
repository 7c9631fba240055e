"""Which quantization a model load uses: parsed once from `LLM(..., quantization=...)`."""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.quant.primitives import INT4_GROUP_SIZES

SCHEMES = ("int8", "int4", "w8a8")
KERNELS = ("auto", "exact", "torch")


@dataclass(frozen=True)
class QuantConfig:
    """scheme: "int8" | "int4" | "w8a8"; group_size: int4 only (32, 64 or 128).

    `quantize_lm_head`: the output projection (49152 x 576 in SmolLM2, the largest matmul of a
    decode step) is quantized by default, always as int8 weight-only whatever the scheme
    (`lm_head_config`). Measured (loadtest/bench_accuracy.py, SmolLM2, KJV windows): with an
    int4 lm_head the int4 model's perplexity was +7.3% over fp32 although its other layers are
    the GGUF's own Q4_1 weights bit for bit (so the fp32 reference has them too): the whole loss
    was the head's. w8a8 with a w8a8 head: +3.8%. With the int8 weight-only head (same run
    setup, bf16 compute, 6 x 512-token windows): int8 +0.55%, int4 +0.33%, w8a8 +3.47%.
    Speed at one row: int8 head 1.3x bf16 (engine/quant/linear.py).
    With the C++ kernel's int8 activations ("auto" on AVX-512 VNNI and AVX2 CPUs, at every row
    count; 2.1x the multiply-adds of the exact path at 32 rows), same setup, 2026-12-04: int4
    +1.79% (exact +0.34%), int8 +0.60% (exact +0.41%), w8a8 +1.95%: within the targets of
    loadtest/bench_accuracy.py (int4 2%, int8 1%, w8a8 3%), hence the default.
    An untied embedding table is never quantized: a lookup reads a few rows, so there is no
    speed to gain. A tied one is looked up in the int8 head's codes (`embedding_from_head`):
    the same weights, not kept twice (54 MiB less for SmolLM2 in bf16).
    """

    scheme: str
    group_size: int = 32
    quantize_lm_head: bool = True
    # "auto": the C++ GEMV of engine/kernels/cpu/quant_gemm.py where it builds (its fastest
    # path: on CPUs with AVX-512 VNNI and VBMI it quantizes bf16 activations to int8 per 32
    # inputs, as llama.cpp does), torch's kernels otherwise; "exact": the C++ GEMV on the
    # paths that keep the activations as they are; "torch": torch's kernels only.
    kernel: str = "auto"
    # w8a8: projections whose activations stay unquantized (int8 weight-only, the same codes).
    w8a8_weight_only: tuple[str, ...] = ("qkv_proj",)
    # A tied embedding looked up in the int8 lm_head's codes, its float table freed (where the
    # runner can: engine/quant/embedding.py); False keeps the float table.
    embedding_from_head: bool = True

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"unknown quantization {self.scheme!r}; expected one of {SCHEMES}")
        if self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(
                f"int4 group size must be one of {INT4_GROUP_SIZES}, got {self.group_size}"
            )
        if self.kernel not in KERNELS:
            raise ValueError(f"quantized kernel must be one of {KERNELS}, got {self.kernel!r}")

    def for_layer(self, name: str) -> QuantConfig:
        """The config of one projection ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        under w8a8 those in `w8a8_weight_only` quantize only their weights.

        Measured (SmolLM2, bf16 compute, 6 x 512-token KJV windows, perplexity vs fp32 24.463):
        every projection w8a8 +3.47%; weight-only qkv_proj +2.15%, down_proj +3.01%, o_proj
        +3.79%, qkv+o +1.69%, down+o +1.77%, down+gate_up +1.99%, down+qkv +0.99%. qkv_proj
        alone is the smallest change that meets the 3% budget (12% of a layer's weights; its
        rows then run the int8 weight-only kernel, slower than `_int_mm` past ~16 rows)."""
        if self.scheme == "w8a8" and name in self.w8a8_weight_only:
            return replace(self, scheme="int8")
        return self

    def lm_head_config(self) -> QuantConfig | None:
        """How lm_head is quantized (None: left in the model dtype)."""
        return QuantConfig("int8", kernel=self.kernel) if self.quantize_lm_head else None

    @property
    def name(self) -> str:
        """Stable name used in cache file names: "int8", "w8a8", "int4-g32"."""
        return f"int4-g{self.group_size}" if self.scheme == "int4" else self.scheme

    @classmethod
    def parse(cls, spec: str | QuantConfig | None) -> QuantConfig | None:
        """None | "int8" | "int4" | "int4-g64" | "int4:64" | "w8a8" | a QuantConfig; a suffix
        "@torch" (or "@auto") sets `kernel`: "int4@torch"."""
        if spec is None or isinstance(spec, QuantConfig):
            return spec
        if not isinstance(spec, str):
            raise ValueError(f"quantization must be a string, got {spec!r}")
        text = spec.strip().lower()
        if text in ("", "none"):
            return None
        text, _, kernel = text.partition("@")
        if text == "w8a8-all":  # every projection's activations quantized (A/B of for_layer)
            return cls("w8a8", w8a8_weight_only=(), kernel=kernel or "auto")
        if kernel:  # "int4@torch": torch's kernels only (A/B runs of the C++ GEMV)
            return replace(cls.parse(text), kernel=kernel)
        for sep in ("-g", ":"):
            if text.startswith("int4" + sep):
                size = text[len("int4" + sep) :]
                if not size.isdigit():
                    raise ValueError(f"bad int4 group size in {spec!r}")
                return cls("int4", int(size))
        return cls(text)
