"""Readiness: a log event, an optional file, and an optional HTTP `GET /healthz`.

Kubernetes probes the port, a shell script waits for the file, a person reads the log. The HTTP
server is a few lines on asyncio rather than a web framework: it answers one path with 200 once
the worker consumes and 503 before (or while shutting down).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)


class Health:
    def __init__(self, port: int | None, ready_file: Path | None) -> None:
        self._port = port
        self._ready_file = ready_file
        self._server: asyncio.AbstractServer | None = None
        self.is_ready = False
        self.details: dict = {}

    @property
    def port(self) -> int | None:
        """The bound port (useful when configured as 0: any free port)."""
        if self._server is None:
            return None
        return self._server.sockets[0].getsockname()[1]

    async def start(self) -> None:
        if self._port is not None:
            self._server = await asyncio.start_server(self._serve, "0.0.0.0", self._port)

    def set_ready(self, is_ready: bool, **details) -> None:
        self.is_ready = is_ready
        self.details.update(details)
        if self._ready_file is not None:
            if is_ready:
                self._ready_file.write_text(json.dumps(self.details, default=str))
            else:
                self._ready_file.unlink(missing_ok=True)
        log.info(
            "worker.ready" if is_ready else "worker.not_ready", health_port=self.port, **details
        )

    async def close(self) -> None:
        if self._ready_file is not None:
            self._ready_file.unlink(missing_ok=True)
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            request_line = await asyncio.wait_for(reader.readline(), 5.0)
            parts = request_line.decode("latin-1").split()
            path = parts[1] if len(parts) > 1 else ""
            if path.split("?")[0] in ("/healthz", "/readyz"):
                status = "200 OK" if self.is_ready else "503 Service Unavailable"
                body = json.dumps({"ready": self.is_ready, **self.details}, default=str).encode()
            else:
                status, body = "404 Not Found", b"{}"
            head = f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            writer.write(head.encode() + body)
            await writer.drain()
        writer.close()
