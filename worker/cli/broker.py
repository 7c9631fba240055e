"""`mini-infer broker [--port N]`: the embedded broker alone, until Ctrl-C; prints its address."""

from __future__ import annotations

import argparse
import signal
import sys
import time

from worker.broker import BrokerError, EmbeddedBroker


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--port", type=int, default=None, help="port on 127.0.0.1 (default: a free one)"
    )


def main(args: argparse.Namespace) -> int:
    from worker.service.log_config import configure_logging

    configure_logging()
    broker = EmbeddedBroker(port=args.port)
    try:
        broker.start()
    except BrokerError as error:
        print(f"mini-infer broker: {error}", file=sys.stderr)
        return 1
    print(broker.bootstrap_servers, flush=True)
    print(
        f"export MINI_INFER_KAFKA__BOOTSTRAP_SERVERS={broker.bootstrap_servers}  # Ctrl-C stops it",
        file=sys.stderr,
        flush=True,
    )
    is_stopped = False

    def _stop(*_) -> None:
        nonlocal is_stopped
        is_stopped = True

    # SIGINT explicitly too: a shell starts background jobs with SIGINT ignored, and Python
    # then never raises KeyboardInterrupt.
    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while not is_stopped and broker.is_running:
            time.sleep(0.2)
    except KeyboardInterrupt:
        is_stopped = True
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        has_died = not broker.is_running
        broker.stop()
    if has_died and not is_stopped:
        print("mini-infer broker: the broker process exited unexpectedly", file=sys.stderr)
        return 1
    return 0
