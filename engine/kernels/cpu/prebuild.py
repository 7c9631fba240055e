"""`python -m engine.kernels.cpu.prebuild`: compile every C++ kernel, for every instruction set
the engine may pick at run time, into the cache dir (`MINI_INFER_CACHE_DIR`).

A container image runs this in its build stage, which has a compiler; the runtime stage has
none and imports these libraries as they are (`extension.build`). The image cannot know the
CPU it will run on, hence every instruction set; a CPU finds its own (`cpu_info().vector_isa`).
Prints one JSON line, {kernel: built?}; exits non-zero when any failed to build.
`--this-machine` (what `make install` runs) builds and loads only what this CPU uses, and
exits 0 either way: a kernel that cannot build here has a torch fallback.
"""

from __future__ import annotations

import json
import sys


def prebuild_all() -> dict[str, bool]:
    from engine.kernels.cpu import bf16_gemm, decode_step, fused_ops, paged_attention, quant_gemm

    built = {}
    for name, kernel in (("paged_attention", paged_attention), ("fused_ops", fused_ops)):
        for isa in kernel._ISA_FLAGS:  # one library per instruction set
            built[f"{name}/{isa}"] = kernel.build(isa=isa) is not None
    # One library each, the instruction set chosen per call.
    built["quant_gemm"] = quant_gemm.build() is not None
    built["bf16_gemm"] = bf16_gemm.build() is not None
    built["decode_step"] = decode_step.build() is not None
    return built


def load_all() -> dict[str, bool]:
    """Build (once) and load what this machine uses: what `make install` runs, so that no
    test or first request pays the compile."""
    from engine.kernels.cpu import bf16_gemm, decode_step, fused_ops, paged_attention, quant_gemm

    kernels = (paged_attention, quant_gemm, bf16_gemm, fused_ops, decode_step)
    return {kernel.__name__.rsplit(".", 1)[1]: kernel.load() is not None for kernel in kernels}


def main() -> int:
    if "--this-machine" in sys.argv[1:]:
        # A kernel this machine cannot build has a torch fallback (logged): not an error here.
        print(json.dumps(load_all()), flush=True)
        return 0
    built = prebuild_all()
    print(json.dumps(built), flush=True)
    return 0 if all(built.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
