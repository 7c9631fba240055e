"""The producer-side SDK: what a service that sends requests imports.

    from worker.client import MiniInferClient  # or SyncMiniInferClient, without asyncio

Depends on `schemas` and aiokafka only (no torch, no engine): installable with the base
distribution (`pip install mini-infer`, see the README's "Packaging").
"""

from worker.client.assembler import Delta, ReplyAssembler
from worker.client.client import (
    ChoiceResult,
    ClientError,
    ClientOptions,
    GenerateResult,
    MiniInferClient,
    RequestFailedError,
    RequestTimeoutError,
)
from worker.client.sync_client import SyncMiniInferClient

__all__ = [
    "ChoiceResult",
    "ClientError",
    "ClientOptions",
    "Delta",
    "GenerateResult",
    "MiniInferClient",
    "ReplyAssembler",
    "RequestFailedError",
    "RequestTimeoutError",
    "SyncMiniInferClient",
]
