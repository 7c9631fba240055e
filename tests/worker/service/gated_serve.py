"""`mini-infer serve` whose engine is held by a gate, for tests that kill or stop a worker
process mid-generation and need "still running" to be a fact, not a race against the machine.

`python -m tests.worker.service.gated_serve <serve arguments>` with MINI_INFER_TEST_GATE=N: the
engine takes no step until N requests were added (so they all run together), then steps until
the first of them finished and every one of them has a token, then never again (its steps
return nothing). A test sends N-1 long requests and one short probe: once the probe's final is
read, the long ones are certainly running (streaming) and can never finish in this process.
"""

from __future__ import annotations

import os
import sys
import time

import worker.service.worker as worker_module
from worker.cli import main

IDLE_STEP_S = 0.005


class GatedEngine:
    def __init__(self, engine, num_requests: int) -> None:
        self._engine = engine
        self._num_requests = num_requests
        self._added: set[str] = set()
        self._streaming: set[str] = set()
        self._is_any_finished = False

    def add_request(self, request_id, *args, **kwargs) -> None:
        self._engine.add_request(request_id, *args, **kwargs)
        self._added.add(request_id)

    @property
    def _is_shut(self) -> bool:
        return self._is_any_finished and self._added <= self._streaming

    def step(self):
        if len(self._added) < self._num_requests or self._is_shut:
            time.sleep(IDLE_STEP_S)  # an empty step: the engine thread still reads its inbox
            return []
        deltas = self._engine.step()
        self._streaming.update(d.request_id for d in deltas if d.token_ids)
        self._is_any_finished |= any(d.finished for d in deltas)
        return deltas

    def __getattr__(self, name: str):
        return getattr(self._engine, name)


def gated_engine_factory(settings):
    build = _default_engine_factory(settings)
    num_requests = int(os.environ["MINI_INFER_TEST_GATE"])
    return lambda: GatedEngine(build(), num_requests)


_default_engine_factory = worker_module.default_engine_factory

if __name__ == "__main__":
    worker_module.default_engine_factory = gated_engine_factory
    sys.exit(main())
