"""`serve` freezes what start-up built, so that a full collection walks only what came after
(the function here; tests/worker/service/test_serve_sigterm.py checks that `serve` calls it)."""

from __future__ import annotations

import gc

from structlog.testing import capture_logs

from worker.service.worker import freeze_start_up_heap


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_start_up_objects_are_frozen_and_later_garbage_is_still_collected():
    kept = _Cycle()  # alive at the freeze: frozen, never walked again
    try:
        with capture_logs() as logs:
            freeze_start_up_heap()
        assert not _in_a_generation(kept)  # frozen: out of every generation
        (line,) = [e for e in logs if e["event"] == "worker.heap_frozen"]
        assert line["num_objects"] > 0 and gc.get_freeze_count() > 0
        assert line["full_collection_ms"] >= 0 and line["full_collection_frozen_ms"] >= 0
        collected = []
        later = _Cycle()  # made after the freeze: a full collection still frees it
        gc.callbacks.append(lambda phase, info: phase == "stop" and collected.append(info))
        del later
        try:
            gc.collect()
        finally:
            gc.callbacks.pop()
        assert collected[-1]["collected"] >= 1
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
    assert _in_a_generation(kept)  # back in a generation: collectable again


def _in_a_generation(obj) -> bool:
    return any(o is obj for o in gc.get_objects())
