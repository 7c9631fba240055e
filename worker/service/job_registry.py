"""The jobs a worker holds, from consumption until they end (DONE or DROPPED): by attempt (also
the engine's request id), by request id (where a duplicate delivery of a running request is
found), and their estimated memory (the consumer pauses past `limits.max_inflight_bytes`).

Bookkeeping only: what a job does next is the pipeline's business."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from worker.service.job import Job, JobState
from worker.service.telemetry import Telemetry


class JobRegistry:
    def __init__(self, telemetry: Telemetry) -> None:
        self._telemetry = telemetry
        self._by_attempt: dict[str, Job] = {}
        self._by_request: dict[str, set[Job]] = {}
        self.inflight_bytes = 0

    def __len__(self) -> int:
        return len(self._by_attempt)

    def add(self, job: Job) -> None:
        self.add_memory(job, len(getattr(job.record, "value", None) or b""))
        self._by_attempt[job.attempt] = job
        self._by_request.setdefault(job.request_id, set()).add(job)

    def add_memory(self, job: Job, num_bytes: int) -> None:
        job.memory_bytes += num_bytes
        self.inflight_bytes += num_bytes

    def get(self, attempt: str) -> Job | None:
        return self._by_attempt.get(attempt)

    def forget(self, job: Job) -> None:
        """The job ended: its memory and its place are given back (once; later calls do
        nothing)."""
        if self._by_attempt.pop(job.attempt, None) is None:
            return
        self.inflight_bytes -= job.memory_bytes
        self._telemetry.inflight_requests.add(-1)
        siblings = self._by_request.get(job.request_id)
        if siblings is not None:
            siblings.discard(job)
            if not siblings:
                del self._by_request[job.request_id]

    def of_request(self, request_id: str) -> list[Job]:
        return list(self._by_request.get(request_id, ()))

    def running_duplicate_of(self, job: Job) -> Job | None:
        """Another active job for the same request, with the same content: `job` is a duplicate
        delivery (a producer retry, a redelivery after a rebalance) of work already here."""
        for other in self._by_request.get(job.request_id, ()):
            if other is not job and other.is_active and other.request == job.request:
                return other
        return None

    @property
    def num_running(self) -> int:
        return sum(1 for j in self._by_attempt.values() if j.state is JobState.RUNNING)

    def jobs_of(self, partitions: Iterable[Any]) -> list[Job]:
        wanted = set(partitions)
        return [j for j in self._by_attempt.values() if j.partition in wanted]

    def active(self) -> list[Job]:
        return [j for j in self._by_attempt.values() if j.is_active]
