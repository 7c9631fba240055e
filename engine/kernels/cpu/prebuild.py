"""`python -m engine.kernels.cpu.prebuild`: compile every C++ kernel, for every instruction set
the engine may pick at run time, into the cache dir (`MINI_INFER_CACHE_DIR`).

A container image runs this in its build stage, which has a compiler; the runtime stage has
none and imports these libraries as they are (`extension.build`). The image cannot know the
CPU it will run on, hence every instruction set; a CPU finds its own (`cpu_info().vector_isa`).
Prints one JSON line, {kernel: built?}; exits non-zero when any failed to build.
"""

from __future__ import annotations

import json
import sys


def prebuild_all() -> dict[str, bool]:
    from engine.kernels.cpu import paged_attention, quant_gemm

    built = {
        f"paged_attention/{isa}": paged_attention.build(isa=isa) is not None
        for isa in paged_attention._ISA_FLAGS
    }
    built["quant_gemm"] = quant_gemm.build() is not None  # one library, ISA chosen per call
    return built


def main() -> int:
    built = prebuild_all()
    print(json.dumps(built), flush=True)
    return 0 if all(built.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
