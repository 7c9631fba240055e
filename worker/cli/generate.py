"""`mini-infer generate "prompt"`: send one request, stream the answer to stdout.

The answer goes to stdout and nothing else does; the finish reason, usage and any problem go to
stderr, so `mini-infer generate "..." > answer.txt` captures just the text. This path imports
the client SDK only (no torch), so it starts in well under a second.

Kafka security (SASL incl. OAUTHBEARER, TLS) comes from the worker's MINI_INFER_KAFKA__* variables
or the same options as flags (worker/client/security.py).

Exit codes: 0 done (stop or length), 1 the worker reported an error or the request was
cancelled/expired, 2 invalid arguments, 3 no final reply in time, 4 Kafka unreachable.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any, TextIO

from aiokafka.errors import KafkaConnectionError, KafkaError
from pydantic import ValidationError

from schemas.codec import describe_validation_error
from schemas.contract import (
    DEFAULT_CONTROL_TOPIC,
    DEFAULT_REPLY_TOPIC_PREFIX,
    DEFAULT_REQUEST_TOPIC,
    SHARED_REPLY_TOPIC_SUFFIX,
)
from schemas.headers import Urgency
from schemas.messages import FinalReply
from worker.client import (
    ClientError,
    ClientOptions,
    MiniInferClient,
    RequestFailedError,
    RequestTimeoutError,
)
from worker.client.security import add_security_arguments, security_from_args

DEFAULT_BOOTSTRAP_SERVERS = "127.0.0.1:9092"
EXIT_OK, EXIT_FAILED, EXIT_INVALID, EXIT_TIMEOUT, EXIT_UNREACHABLE = 0, 1, 2, 3, 4
RESTART_NOTICE = "\n[mini-infer: a retry of this request diverged; its answer follows]\n"


def _env(name: str, default: str) -> str:
    return os.environ.get(f"MINI_INFER_KAFKA__{name}") or default


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "prompt", help="the user message (with --raw: a plain completion prompt)"
    )
    parser.add_argument(
        "--bootstrap-servers",
        default=None,
        help="host:port (default: $MINI_INFER_KAFKA__BOOTSTRAP_SERVERS or 127.0.0.1:9092)",
    )
    parser.add_argument("--urgency", choices=[u.value for u in Urgency], default="normal")
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=None, help="0 is greedy")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--n", type=int, default=None,
        help="samples of the prompt (choice i seeded seed + i); more than 1 prints each at the "
        "end, after a '[choice i]' line",
    )  # fmt: skip
    parser.add_argument(
        "--stop", action="append", default=None, metavar="TEXT", help="stop string (repeatable)"
    )
    parser.add_argument(
        "--raw",
        action="store_true",
        help="send a plain completion prompt instead of a chat message (for base models)",
    )
    parser.add_argument(
        "--no-stream", action="store_true", help="print the answer once, at the end"
    )
    parser.add_argument(
        "--timeout-s", type=float, default=60.0, help="wait this long for the final"
    )
    parser.add_argument("--request-id", default=None, help="default: a random uuid")
    add_security_arguments(parser)


def main(args: argparse.Namespace) -> int:
    from worker.service.log_config import configure_logging

    configure_logging(level="warning")  # stdout carries the answer only
    return asyncio.run(run(args, sys.stdout, sys.stderr))


async def run(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    bootstrap_servers = args.bootstrap_servers or _env(
        "BOOTSTRAP_SERVERS", DEFAULT_BOOTSTRAP_SERVERS
    )
    try:
        security = security_from_args(args)
    except (ValueError, OSError) as exc:  # a bad combination, or an unreadable file
        print(f"mini-infer generate: invalid Kafka security options: {exc}", file=err)
        return EXIT_INVALID
    try:  # bad arguments and settings fail here, before any connection
        reply_prefix = _env("REPLY_TOPIC_PREFIX", DEFAULT_REPLY_TOPIC_PREFIX)
        options = ClientOptions(
            kafka=security,
            request_topic=_env("REQUEST_TOPIC", DEFAULT_REQUEST_TOPIC),
            # By lane (contract v1.2) unless the workers run without: the same variable.
            urgency_lanes=_env("URGENCY_LANES", "true").lower() not in ("false", "0", "off"),
            control_topic=_env("CONTROL_TOPIC", DEFAULT_CONTROL_TOPIC),
            reply_prefix=reply_prefix,
            # the worker's default, `<reply_topic_prefix>shared` (contract v1.2)
            reply_topic=_env("SHARED_REPLY_TOPIC", reply_prefix + SHARED_REPLY_TOPIC_SUFFIX),
        )
        client = MiniInferClient(bootstrap_servers, options)
        client.build_request(**request_fields(args))
    except ValueError as exc:  # pydantic's ValidationError and our DecodeError among them
        message = describe_validation_error(exc) if isinstance(exc, ValidationError) else str(exc)
        print(f"mini-infer generate: invalid request: {message}", file=err)
        return EXIT_INVALID
    try:
        async with client:
            final = await _answer(client, args, out, err)
    except RequestFailedError as exc:
        print(f"mini-infer generate: the request failed: {exc}", file=err)
        return EXIT_FAILED
    except RequestTimeoutError:
        print(f"mini-infer generate: no answer within {args.timeout_s} s", file=err)
        return EXIT_TIMEOUT
    except (KafkaConnectionError, OSError) as exc:
        print(f"mini-infer generate: cannot reach Kafka at {bootstrap_servers}: {exc}", file=err)
        return EXIT_UNREACHABLE
    except (KafkaError, ClientError) as exc:
        print(f"mini-infer generate: {type(exc).__name__}: {exc}", file=err)
        return EXIT_FAILED
    print(describe_final(final), file=err)
    return EXIT_OK if final.finish_reason in ("stop", "length") else EXIT_FAILED


def request_fields(args: argparse.Namespace) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "n": args.n,
        "stop": args.stop,
        "request_id": args.request_id,
    }
    # An instruct model answers a chat message; a raw prompt is only continued ("What is the
    # capital of France?" went on "Climate in America 1782 ..." with SmolLM2-Instruct).
    if args.raw:
        fields["prompt"] = args.prompt
    else:
        fields["messages"] = [{"role": "user", "content": args.prompt}]
    return fields


async def _answer(
    client: MiniInferClient, args: argparse.Namespace, out: TextIO, err: TextIO
) -> FinalReply:
    options = {**request_fields(args), "urgency": args.urgency, "timeout_s": args.timeout_s}
    if (args.n or 1) > 1:  # choices would interleave on the terminal: each whole, in turn
        final = None
        async for delta in client.stream(**{**options, "stream": False}):
            final = delta.final or final
        for choice in final.choices or ():
            out.write(f"[choice {choice.index}]\n{choice.text}\n")
        out.flush()
        return final
    if args.no_stream:
        options["stream"] = False
    final = None
    async for delta in client.stream(**options):
        if args.no_stream:
            final = delta.final or final
            continue
        if delta.is_restart:
            err.write(RESTART_NOTICE)
            err.flush()
        out.write(delta.text)
        out.flush()
        final = delta.final or final
    if args.no_stream:
        out.write(final.text)
    out.write("\n")
    out.flush()
    return final


def describe_final(final: FinalReply) -> str:
    timing = final.timing
    ttft = "-" if timing.ttft_ms is None else f"{timing.ttft_ms:.0f}"
    return (
        f"[finish_reason={final.finish_reason} prompt_tokens={final.usage.prompt_tokens} "
        f"completion_tokens={final.usage.completion_tokens} queued_ms={timing.queued_ms:.0f} "
        f"ttft_ms={ttft} total_ms={timing.total_ms:.0f}]"
    )
