"""Starting the embedded broker when its port is taken: a listener that accepts connections on
the port is not proof that the broker came up (it may be another process's, when two test
processes picked the same free port), and a port picked here that was taken meanwhile is given
up for another."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import structlog.testing

from worker import broker as broker_module
from worker.broker import BrokerError, EmbeddedBroker, PortTakenError, _listener_owned_by

pytestmark = pytest.mark.kafka


@pytest.fixture
def foreign_listener():
    """A port something other than a broker listens on (and accepts connections)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((broker_module.HOST, 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_an_explicit_port_another_process_listens_on_is_an_error_not_a_started_broker(
    foreign_listener,
) -> None:
    """Guards against `start` taking the other listener's accepted connection for its broker's
    (it returned "started" while its broker had exited)."""
    broker = EmbeddedBroker(port=foreign_listener)
    with pytest.raises(PortTakenError, match="already in use"):
        broker.start()
    assert not broker.is_running
    assert broker.port == foreign_listener  # an explicit port is never swapped for another


def test_a_picked_port_taken_meanwhile_is_given_up_for_another(
    foreign_listener, monkeypatch
) -> None:
    picks = iter([foreign_listener])
    real_pick = broker_module.find_free_port
    monkeypatch.setattr(broker_module, "find_free_port", lambda: next(picks, None) or real_pick())
    with structlog.testing.capture_logs() as logs, EmbeddedBroker() as broker:
        assert broker.is_running
        assert broker.port != foreign_listener
        assert _listener_owned_by(broker.pid, broker.port) is True
    assert [e["port"] for e in logs if e["event"] == "broker.port_taken"] == [foreign_listener]


def test_a_listener_belongs_to_the_process_holding_its_socket(foreign_listener) -> None:
    if _listener_owned_by(os.getpid(), foreign_listener) is None:
        pytest.skip("no /proc here to tell a listener's process")
    assert _listener_owned_by(os.getpid(), foreign_listener) is True
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]) as other:
        try:
            assert _listener_owned_by(other.pid, foreign_listener) is False
        finally:
            other.kill()


def test_when_every_picked_port_is_taken_the_error_says_so_and_the_next_start_picks_again(
    foreign_listener, monkeypatch
) -> None:
    monkeypatch.setattr(broker_module, "find_free_port", lambda: foreign_listener)
    broker = EmbeddedBroker()
    with pytest.raises(BrokerError, match="free ports were taken"):
        broker.start()
    assert broker.port is None and not broker.is_running
