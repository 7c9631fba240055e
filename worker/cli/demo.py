"""`mini-infer demo` (what `make run` runs): the whole path on one machine.

An embedded broker, one worker on the default model (SmolLM2-135M-Instruct), and the client SDK
sending three questions at once with different urgencies (low, normal, critical). Answers are
shown one at a time, each streamed live once it has the terminal, in the order their first
tokens arrived; the others are kept until their turn, then caught up and streamed on. Each ends
with its finish reason and the worker's timings. Logs go to stderr at warning level only.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass, field

from worker.broker import EmbeddedBroker
from worker.service.settings import WorkerSettings
from worker.service.worker import Worker

QUESTIONS = [
    ("low", "Write a short poem about the sea."),
    ("normal", "Explain in two sentences what Apache Kafka is."),
    ("critical", "What is the capital of France? Answer in one sentence."),
]


@dataclass
class Answer:
    urgency: str
    question: str
    parts: list[str] = field(default_factory=list)
    num_shown: int = 0  # parts already written to the terminal
    first_token_s: float | None = None
    final: object | None = None
    error: str | None = None

    @property
    def is_done(self) -> bool:
        return self.final is not None or self.error is not None


class Display:
    """One answer has the terminal at a time; the rest wait their turn (first token first)."""

    def __init__(self, answers: list[Answer], out=None) -> None:
        self._answers = answers
        self._out = out or sys.stdout
        self._current: Answer | None = None
        self._finished: list[Answer] = []

    def update(self) -> None:
        while True:
            if self._current is None:
                waiting = [
                    a for a in self._answers if a not in self._finished and (a.parts or a.is_done)
                ]
                if not waiting:
                    return
                self._current = min(waiting, key=lambda a: a.first_token_s or float("inf"))
                self._write(f"\n[{self._current.urgency}] {self._current.question}\n  > ")
            answer = self._current
            for part in answer.parts[answer.num_shown :]:
                self._write(part.replace("\n", "\n    "))
            answer.num_shown = len(answer.parts)
            if not answer.is_done:
                return
            self._write("\n" + _summary(answer) + "\n")
            self._finished.append(answer)
            self._current = None

    def _write(self, text: str) -> None:
        self._out.write(text)
        self._out.flush()


def _summary(answer: Answer) -> str:
    if answer.error is not None:
        return f"  ({answer.urgency}: failed: {answer.error})"
    final = answer.final
    ttft = "-" if final.timing.ttft_ms is None else f"{final.timing.ttft_ms:.0f} ms"
    return (
        f"  ({answer.urgency}: {final.finish_reason}, {final.usage.completion_tokens} tokens, "
        f"first token after {ttft}, total {final.timing.total_ms:.0f} ms)"
    )


async def ask(client, answer: Answer, display: Display, max_tokens: int) -> None:
    try:
        async for delta in client.stream(
            messages=[{"role": "user", "content": answer.question}],
            urgency=answer.urgency,
            max_tokens=max_tokens,
            temperature=0.0,
            timeout_s=300,
        ):
            if answer.first_token_s is None and (delta.text or delta.final is not None):
                answer.first_token_s = time.monotonic()
            if delta.is_restart:  # a retried attempt diverged: start the answer over
                answer.parts, answer.num_shown = [], 0
            if delta.text:
                answer.parts.append(delta.text)
            if delta.final is not None:
                answer.final = delta.final
            display.update()
    except Exception as error:  # shown in place of the answer; the demo goes on
        answer.error = f"{type(error).__name__}: {error}"
        display.update()


async def run_demo(settings: WorkerSettings, max_tokens: int) -> int:
    from worker.client import ClientOptions, MiniInferClient

    started_s = time.monotonic()
    answers = [Answer(urgency, question) for urgency, question in QUESTIONS]
    async with EmbeddedBroker(port=settings.kafka.embedded_port) as broker:
        print(
            f"embedded broker on {broker.bootstrap_servers}; loading {settings.model} ...",
            flush=True,
        )
        worker = Worker(settings, broker.bootstrap_servers)
        await worker.start()
        try:
            await worker.wait_assigned()
            print(
                f"worker ready after {time.monotonic() - started_s:.1f} s; asking three questions at once",
                flush=True,
            )
            kafka = settings.kafka
            options = ClientOptions(
                request_topic=kafka.request_topic,
                urgency_lanes=kafka.urgency_lanes,
                reply_prefix=kafka.reply_topic_prefix,
                reply_topic=kafka.shared_reply_topic_name,
                control_topic=kafka.control_topic,
            )
            async with MiniInferClient(broker.bootstrap_servers, options) as client:
                display = Display(answers)
                await asyncio.gather(*(ask(client, a, display, max_tokens) for a in answers))
        finally:
            await worker.stop(grace_s=5)
    print(f"\ndone in {time.monotonic() - started_s:.1f} s", flush=True)
    return 0 if all(a.error is None for a in answers) else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="default: the configured model (smollm2-135m)"
    )
    parser.add_argument("--max-tokens", type=int, default=64)


def main(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from worker.service.log_config import configure_logging

    try:
        settings = WorkerSettings(**({"model": args.model} if args.model else {}))
    except ValidationError as error:
        print(f"mini-infer demo: invalid settings:\n{error}", file=sys.stderr)
        return 2
    configure_logging("warning", settings.observability.log_format)
    return asyncio.run(run_demo(settings, args.max_tokens))
