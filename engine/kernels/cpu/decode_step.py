"""The fused decode step's C++ library (decode_step.cpp): built on the running machine and loaded
here, below the layers. engine/fused_decode.py composes a model's layers into the step's tasks
and runs it; why the step exists is told there.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

from engine.kernels.cpu import extension

SOURCE = Path(__file__).with_name("decode_step.cpp")
SPIN = 4000  # barrier: pause rounds (~100 us) before a waiting thread sleeps
# decode_step.cpp's task modes (kSplit, a contiguous equal share per thread, is the default):
# every thread does all items; shared out from a counter; split below 8 rows and shared from it;
# every thread below the task's `least` rows, split from it with a barrier after.
TASK_EVERY_THREAD, TASK_DYNAMIC, TASK_DYNAMIC_MANY, TASK_EVERY_THEN_SPLIT = 1, 2, 3, 4
# A dynamic GEMV's smallest take of blocks at its end, in bytes of weights (a task's `least`).
LEAST_TAKE_BYTES = 64 << 10


def extension_name() -> str:
    return f"mini_infer_decode_step_{extension.source_digest(SOURCE)}"


def build(build_root: Path | None = None) -> ModuleType | None:
    return extension.build(extension_name(), SOURCE, [], build_root, event="decode_step")


@functools.cache
def load() -> ModuleType | None:
    return build()
