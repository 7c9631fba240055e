"""Shared fixtures: one embedded broker per session (for `kafka` tests) and tiny random models."""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter. `triton.jit` reads this when a
# kernel is decorated, and triton.language's own helpers are decorated when Triton is first
# imported, which importing transformers below already does: so it is set here, first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# A kernel that fails to compile where a compiler exists fails its tests instead of skipping
# them as "no compiler" (engine/kernels/cpu/extension.py).
os.environ.setdefault("MINI_INFER_KERNEL_BUILD_STRICT", "1")
# Workers started in-process would lower the test runner's own thread (worker/service/worker.py,
# event_loop_nice and event_loop_policy; tested on their own in
# tests/worker/service/test_loop_priority.py).
os.environ.setdefault("MINI_INFER_EVENT_LOOP_NICE", "0")
os.environ.setdefault("MINI_INFER_EVENT_LOOP_POLICY", "normal")

from tests.tiny_model import make_tiny_llama
from worker.broker import EmbeddedBroker


@pytest.fixture(scope="session")
def broker():
    """The embedded Tansu broker on 127.0.0.1, shared by every `kafka` test of the session.
    Tests keep apart by using fresh topic names and group ids (`unique_name`). The shared
    reply topic (contract v1.2) is provisioned up front, as ops or the first worker would: SDK
    clients never create it, and some tests start a client before any worker."""
    with EmbeddedBroker() as running:
        asyncio.run(_provision_shared_reply_topic(running.bootstrap_servers))
        yield running


async def _provision_shared_reply_topic(bootstrap_servers: str) -> None:
    from aiokafka.admin import AIOKafkaAdminClient

    from schemas.contract import DEFAULT_SHARED_REPLY_TOPIC, NUM_SHARED_REPLY_TOPIC_PARTITIONS
    from worker.topics import create_topics

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers, request_timeout_ms=30_000)
    await admin.start()
    try:
        await create_topics(
            admin, {DEFAULT_SHARED_REPLY_TOPIC: NUM_SHARED_REPLY_TOPIC_PARTITIONS}, 1
        )
    finally:
        await admin.close()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A random tiny Llama checkpoint (HF directory with tokenizer and chat template)."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def unique_name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"
