"""Health and metrics over HTTP (aiohttp), a ready file, and a log event.

- `GET /healthz`, liveness: 200 while the worker can make progress. It is answered by the event
  loop itself, so a blocked loop fails the probe by timing out; and it asks the worker whether
  the engine thread is alive and not stalled (it has work but finished no step for
  `engine_stall_s`). Kubernetes restarts a pod that fails it.
- `GET /readyz`, readiness: 200 once the model is loaded and warmed up, the consumer runs, and
  polling the broker succeeds: started and able to work. Holding partitions is not asked (a
  surge pod during a rollout holds none yet); that is the `partitions.assigned` metric.
- `GET /metrics`: the worker's OpenTelemetry metrics in Prometheus text format.

Each check answers JSON naming every condition, so a failing probe says why.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Protocol

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = structlog.get_logger(__name__)


class Probes(Protocol):
    """What the worker reports about itself; each value is one named condition."""

    def liveness(self) -> dict[str, bool]: ...
    def readiness(self) -> dict[str, bool]: ...


class Health:
    def __init__(
        self,
        port: int | None,
        ready_file: Path | None,
        probes: Probes,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self._port = port
        self._ready_file = ready_file
        self._probes = probes
        self._registry = registry
        self._runner: web.AppRunner | None = None
        self.bound_port: int | None = None
        self.is_started = False  # model loaded, warmed up, consuming
        self.details: dict = {}

    @property
    def port(self) -> int | None:
        """The bound port (useful when configured as 0: any free port)."""
        return self.bound_port

    async def start(self) -> None:
        if self._port is None:
            return
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "0.0.0.0", self._port)
        await site.start()
        self.bound_port = self._runner.addresses[0][1]

    def set_ready(self, is_started: bool, **details) -> None:
        """The worker finished starting (True) or began stopping (False)."""
        self.is_started = is_started
        self.details.update(details)
        if self._ready_file is not None:
            if is_started:  # with the bound health port (configured as 0: any free port)
                ready = {**self.details, "health_port": self.port}
                # Written aside and renamed: a reader that sees the file sees all of it.
                staged = self._ready_file.with_name(self._ready_file.name + ".tmp")
                staged.write_text(json.dumps(ready, default=str))
                os.replace(staged, self._ready_file)
            else:
                self._ready_file.unlink(missing_ok=True)
        log.info(
            "worker.ready" if is_started else "worker.not_ready",
            health_port=self.port,
            **details,
        )

    def readiness(self) -> dict[str, bool]:
        return {"started": self.is_started, **(self._probes.readiness() if self.is_started else {})}

    async def close(self) -> None:
        if self._ready_file is not None:
            self._ready_file.unlink(missing_ok=True)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _healthz(self, request: web.Request) -> web.Response:
        return _answer(self._probes.liveness(), self.details)

    async def _readyz(self, request: web.Request) -> web.Response:
        return _answer(self.readiness(), self.details)

    async def _metrics(self, request: web.Request) -> web.Response:
        if self._registry is None:
            raise web.HTTPNotFound(text="metrics are off (observability.prometheus=false)")
        body = generate_latest(self._registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def _answer(checks: dict[str, bool], details: dict) -> web.Response:
    is_ok = all(checks.values())
    body = json.dumps({"ok": is_ok, "checks": checks, **details}, default=str)
    return web.Response(
        status=200 if is_ok else 503, text=body, content_type="application/json"
    )
