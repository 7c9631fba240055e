"""The dead-letter writer: one for the whole worker, used by the consumer (messages that cannot
be answered) and the pipeline (requests whose final the reply topic refused).

The dead letter is the original record, bytes untouched, with headers saying why and where it
came from (`schemas.headers.dlq_headers`), so an operator can find and replay it. Its offset is
finished once the broker acknowledges the dead letter; if every try fails the offset stays
unfinished, so the request is redelivered after a restart rather than silently lost.
"""

from __future__ import annotations

from typing import Any

import structlog

from schemas.headers import dlq_headers
from worker.service.delivery import deliver
from worker.service.offsets import OffsetTracker
from worker.service.publisher import Outgoing, Publisher
from worker.service.telemetry import Telemetry

log = structlog.get_logger(__name__)


class DeadLetterWriter:
    def __init__(
        self,
        publisher: Publisher,
        tracker: OffsetTracker,
        telemetry: Telemetry,
        dlq_topic: str,
        num_retries: int,
    ) -> None:
        self._publisher = publisher
        self._tracker = tracker
        self._telemetry = telemetry
        self._dlq_topic = dlq_topic
        self._num_retries = num_retries

    def write(self, partition: Any, record: Any, reason: str, message: str) -> None:
        """Set `record` (consumed from `partition`) aside; finishes its offset once acked."""
        log.warning("request.dead_lettered", reason=reason, error=message)
        self._telemetry.dlq_messages.add(1, {"reason": reason})
        headers = dlq_headers(
            record.headers, reason=reason, message=message,
            topic=partition.topic, partition=partition.partition, offset=record.offset,
        )  # fmt: skip
        outcome = deliver(
            self._publisher,
            lambda: Outgoing(self._dlq_topic, record.key, record.value, headers),
            self._num_retries,
            "dead_letter",
        )

        def done(_) -> None:
            error = outcome.exception()
            if error is None:
                self._tracker.finish(partition, record.offset)
            else:  # left unfinished: never committed, so it is redelivered after a restart
                log.error("request.dead_letter_failed", offset=record.offset, error=repr(error))

        outcome.add_done_callback(done)
