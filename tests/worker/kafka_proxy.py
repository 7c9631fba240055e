"""A fault-injecting Kafka proxy for tests: between clients and the embedded broker, on 127.0.0.1.

The test broker is not Apache Kafka, and its differences hide defects (see tests/worker/README.md).
The proxy relays Kafka frames and, with aiokafka's own protocol classes, rewrites the few it must:

- Metadata and FindCoordinator responses advertise the proxy, so every connection a client
  opens after bootstrap also goes through it;
- Fetch requests are sent with `max_wait_time` = `fetch_max_wait_ms` (default 1 ms): answered
  at once, as Apache Kafka answers when data is there (the test broker otherwise holds each
  fetch ~20 ms, or the client's whole wait when idle; at 0 it answers every fetch empty);
- produce requests for the topics in `failing_topics` are answered by the proxy itself with the
  chosen error (e.g. NOT_ENOUGH_REPLICAS, retriable: an idempotent producer retries it forever),
  while the other topics of the same request go to the broker;
- responses of chosen APIs are delayed (`delay(api_key, seconds)`), in order on their connection,
  or held until an event is set (`hold(api_key, event)`);
- `cut()` closes every connection, as a broker restart or a network fault would;
- `hide_batch(topic, index=1)`: the next fetch response holding a batch after batch `index`
  of a partition of `topic` loses that batch (the second, by default), as a fetch that raced a
  write from another connection does on the embedded broker now and then (a later batch
  visible, an earlier one not yet): a gap in the offsets that a refetch fills.

Requests of flexible versions (tagged header fields) are relayed untouched; only the fixed
header fields (key, version, correlation id) are read from them.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections import deque
from dataclasses import dataclass
from io import BytesIO

from aiokafka.protocol import admin, commit, coordination, fetch, metadata, offset, produce
from aiokafka.protocol.api import RequestStruct

PRODUCE, FETCH, METADATA, OFFSET_FETCH, FIND_COORDINATOR = 0, 1, 3, 9, 10
NOT_ENOUGH_REPLICAS = 19


def _request_classes() -> dict[tuple[int, int], type[RequestStruct]]:
    classes = {}
    for module in (admin, commit, coordination, fetch, metadata, offset, produce):
        for value in vars(module).values():
            is_request = isinstance(value, type) and issubclass(value, RequestStruct)
            if is_request and hasattr(value, "API_VERSION") and not value.FLEXIBLE_VERSION:
                classes[(value.API_KEY, value.API_VERSION)] = value
    return classes


_REQUESTS = _request_classes()


@dataclass
class _Pending:
    """One request's answer slot on a connection: answers go back in request order."""

    correlation_id: int
    api_key: int
    api_version: int
    answer: asyncio.Future[bytes]
    failed_topics: list | None = None  # produce: (topic, partitions, error) failed here
    delay_s: float = 0.0
    gate: asyncio.Event | None = None  # the answer waits until it is set


class KafkaProxy:
    """`async with KafkaProxy(broker.bootstrap_servers) as proxy:` then connect to
    `proxy.bootstrap_servers`. Faults can be changed at any time."""

    def __init__(self, upstream: str, fetch_max_wait_ms: int | None = 1) -> None:
        host, port = upstream.rsplit(":", 1)
        self._upstream = (host, int(port))
        self.fetch_max_wait_ms = fetch_max_wait_ms  # None: relay the client's value
        self.failing_topics: dict[str, int] = {}  # topic -> error code for its produces
        self._delays: dict[int, tuple] = {}  # api key -> (seconds, predicate or None)
        self._gates: dict[int, asyncio.Event] = {}  # api key -> answers held until set
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[asyncio.Task] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0
        self.num_failed_produces = 0
        self.hidden_batches: dict[str, list[int]] = {}  # topic -> indexes of batches to hide
        self.num_hidden_batches = 0

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.port}"

    def fail_produce(self, topic: str, error_code: int = NOT_ENOUGH_REPLICAS) -> None:
        self.failing_topics[topic] = error_code

    def delay(self, api_key: int, seconds: float, when=None) -> None:
        """Hold the responses of `api_key` for `seconds` (0 lifts it): all of them, or those
        whose decoded request `when(request)` is true (requests of flexible versions: never).
        Answers keep their order on a connection, so later ones on it wait too."""
        self._delays[api_key] = (seconds, when)

    def hold(self, api_key: int, gate: asyncio.Event | None) -> None:
        """Hold the answers of `api_key` requests made from now on until `gate` is set (None:
        stop holding). As with `delay`, later answers on the same connection wait too."""
        if gate is None:
            self._gates.pop(api_key, None)
        else:
            self._gates[api_key] = gate

    def hide_batch(self, topic: str, index: int = 1) -> None:
        """Hide record batch `index` of the next fetch response that holds a batch after it,
        of a partition of `topic` (once per call)."""
        self.hidden_batches.setdefault(topic, []).append(index)

    def cut(self) -> None:
        """Close every open connection (clients reconnect through the proxy)."""
        for writer in list(self._writers):
            writer.close()

    async def __aenter__(self) -> KafkaProxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc_info) -> None:
        self._server.close()
        self.cut()  # every connection task ends on its closed sockets
        await asyncio.wait_for(asyncio.gather(*self._connections, return_exceptions=True), 5)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), 5)

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter):
        task = asyncio.current_task()
        self._connections.add(task)
        self._writers.add(client_w)
        upstream_w = None
        try:
            upstream_r, upstream_w = await asyncio.open_connection(*self._upstream)
            self._writers.add(upstream_w)
            pending: deque[_Pending] = deque()
            by_id: dict[int, _Pending] = {}
            ready = asyncio.Event()
            parts = [
                self._requests(client_r, upstream_w, pending, by_id, ready),
                self._responses(upstream_r, by_id),
                self._answers(client_w, pending, ready),
            ]
            tasks = [asyncio.create_task(p) for p in parts]
            try:
                await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            for writer in (client_w, upstream_w):
                if writer is not None:
                    self._writers.discard(writer)
                    writer.close()
            self._connections.discard(task)

    async def _requests(self, reader, upstream_w, pending, by_id, ready) -> None:
        while True:
            frame = await _read_frame(reader)
            api_key, api_version, correlation_id = struct.unpack(">hhi", frame[:8])
            slot = _Pending(
                correlation_id, api_key, api_version, asyncio.get_running_loop().create_future()
            )
            pending.append(slot)
            ready.set()
            frame = self._rewrite_request(slot, frame)
            if frame is None:  # answered here: nothing of it goes to the broker
                slot.answer.set_result(_produce_response(slot, None))
                continue
            by_id[correlation_id] = slot
            upstream_w.write(struct.pack(">i", len(frame)) + frame)
            await upstream_w.drain()

    async def _responses(self, reader, by_id) -> None:
        while True:
            frame = await _read_frame(reader)
            (correlation_id,) = struct.unpack(">i", frame[:4])
            slot = by_id.pop(correlation_id)
            slot.answer.set_result(self._rewrite_response(slot, frame))

    async def _answers(self, writer, pending, ready) -> None:
        while True:
            while not pending:
                ready.clear()
                await ready.wait()
            slot = pending[0]
            frame = await slot.answer
            if slot.delay_s:
                await asyncio.sleep(slot.delay_s)
            if slot.gate is not None:
                await slot.gate.wait()
            pending.popleft()
            writer.write(struct.pack(">i", len(frame)) + frame)
            await writer.drain()

    def _rewrite_request(self, slot: _Pending, frame: bytes) -> bytes | None:
        cls = _REQUESTS.get((slot.api_key, slot.api_version))
        slot.gate = self._gates.get(slot.api_key)
        delay_s, when = self._delays.get(slot.api_key, (0.0, None))
        if delay_s and when is None:
            slot.delay_s = delay_s
        elif delay_s and cls is not None:
            buffer = BytesIO(frame)
            _header(buffer)
            slot.delay_s = delay_s if when(cls.decode(buffer)) else 0.0
        wants_fetch = slot.api_key == FETCH and self.fetch_max_wait_ms is not None
        wants_produce = slot.api_key == PRODUCE and self.failing_topics
        if cls is None or not (wants_fetch or wants_produce):
            return frame
        buffer = BytesIO(frame)
        header = _header(buffer)
        request = cls.decode(buffer)
        if wants_fetch:
            request.max_wait_time = self.fetch_max_wait_ms
        else:
            kept = [t for t in request.topics if t[0] not in self.failing_topics]
            failed = [t for t in request.topics if t[0] in self.failing_topics]
            if not failed:
                return frame
            self.num_failed_produces += 1
            slot.failed_topics = [(t[0], t[1], self.failing_topics[t[0]]) for t in failed]
            if not kept:
                return None
            request.topics = kept
        return header + request.encode()

    def _rewrite_response(self, slot: _Pending, frame: bytes) -> bytes:
        if slot.api_key == PRODUCE and slot.failed_topics:
            return _produce_response(slot, frame)
        if slot.api_key == FETCH and any(self.hidden_batches.values()):
            return self._hide_batches(slot, frame)
        if slot.api_key not in (METADATA, FIND_COORDINATOR):
            return frame
        cls = _REQUESTS.get((slot.api_key, slot.api_version))
        if cls is None:
            return frame
        response = cls.RESPONSE_TYPE.decode(BytesIO(frame[4:]))
        if slot.api_key == METADATA:
            response.brokers = [(b[0], "127.0.0.1", self.port, *b[3:]) for b in response.brokers]
        else:
            response.host, response.port = "127.0.0.1", self.port
        return frame[:4] + response.encode()


    def _hide_batches(self, slot: _Pending, frame: bytes) -> bytes:
        cls = _REQUESTS.get((slot.api_key, slot.api_version))
        if cls is None:
            return frame
        response = cls.RESPONSE_TYPE.decode(BytesIO(frame[4:]))
        changed = False
        response.topics = list(response.topics)
        for t, (topic, partitions) in enumerate(response.topics):
            pending = self.hidden_batches.get(topic)
            if not pending:
                continue
            partitions = list(partitions)
            for p, partition in enumerate(partitions):
                batches = _batches(bytes(partition[-1] or b""))  # the record set is the last field
                if pending and len(batches) >= pending[0] + 2:
                    index = pending.pop(0)
                    self.num_hidden_batches += 1
                    kept = batches[:index] + batches[index + 1 :]
                    partitions[p] = (*partition[:-1], b"".join(kept))
                    changed = True
            response.topics[t] = (topic, partitions)
        return frame[:4] + response.encode() if changed else frame


def _batches(records: bytes) -> list[bytes]:
    """A record set split into its whole batches (base offset, length, then that many bytes);
    a partial batch at the end (cut by the fetch size) is kept as it is."""
    batches, start = [], 0
    while start + 12 <= len(records):
        (length,) = struct.unpack(">i", records[start + 8 : start + 12])
        end = min(start + 12 + length, len(records))
        batches.append(records[start:end])
        start = end
    if start < len(records):
        batches.append(records[start:])
    return batches


def _produce_response(slot: _Pending, frame: bytes | None) -> bytes:
    """The broker's answer (if any) plus an error for each partition the proxy failed."""
    cls = _REQUESTS[(PRODUCE, slot.api_version)].RESPONSE_TYPE
    if frame is None:
        response = cls(*[[] if n == "topics" else 0 for n in cls.SCHEMA.names])
    else:
        response = cls.decode(BytesIO(frame[4:]))
    partition_fields = cls.SCHEMA.fields[0].array_of.fields[1].array_of.names
    for topic, partitions, error_code in slot.failed_topics:
        rows = []
        for partition in partitions:
            values = {"partition": partition[0], "error_code": error_code}
            rows.append(tuple(values.get(name, -1) for name in partition_fields))
        response.topics.append((topic, rows))
    return struct.pack(">i", slot.correlation_id) + response.encode()


def _header(buffer: BytesIO) -> bytes:
    """The non-flexible request header (key, version, correlation id, client id), raw."""
    start = buffer.read(8)
    (length,) = struct.unpack(">h", buffer.read(2))
    client_id = buffer.read(length) if length > 0 else b""
    return start + struct.pack(">h", length) + client_id


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    (size,) = struct.unpack(">i", await reader.readexactly(4))
    return await reader.readexactly(size)
