"""Topic administration: the worker's own topics at start-up, reply topics on first use.

The worker creates what it needs instead of relying on broker auto-creation: auto-created topics
get the broker's default partition count (4 on the embedded broker, 1 on Kafka), and the embedded
broker forgets every topic when it restarts.

Reply topics are named by producers, so their creation is bounded by settings
(`kafka.reply_topics`): switched off (pre-provisioned topics only), a limit on how many one
worker creates in its life, and a rate (a token bucket). A topic this worker has not seen is
first looked up in the broker's metadata: only one that is really missing is created and
charged to the budget. A request whose reply topic (or `reply_partition`, v1.2) is missing and
may not be created is dead-lettered (`reply_topic_unavailable`). Transient CreateTopics failures (timeouts, a
broker mid-restart) are retried with backoff; only a refusal the broker means (invalid name,
not authorised, policy) or the last retry's failure gives up. Creation never blocks the poll
loop: the consumer awaits it out of line, for the one request that needs it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import structlog
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from schemas.contract import NUM_REPLY_TOPIC_PARTITIONS
from worker.service.settings import KafkaSettings, ReplyTopicSettings
from worker.topics import create_topics, num_partitions_of

log = structlog.get_logger(__name__)
T = TypeVar("T")


class TopicCreationRefused(Exception):
    """This worker may not create the topic (pre-provisioned only, or over a limit)."""


class TokenBucket:
    """`rate_per_s` tokens a second, at most `burst` saved up. Takes its clock as an argument."""

    def __init__(self, rate_per_s: float, burst: int, clock=time.monotonic) -> None:
        self._rate_per_s = rate_per_s
        self._burst = burst
        self._clock = clock
        self._tokens = float(burst)
        self._last_s = clock()

    def take(self) -> bool:
        now_s = self._clock()
        self._tokens = min(self._burst, self._tokens + (now_s - self._last_s) * self._rate_per_s)
        self._last_s = now_s
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True


def is_transient(error: BaseException) -> bool:
    """Worth another try: a timeout, a lost connection, or a Kafka error marked retriable."""
    if isinstance(error, OSError | TimeoutError):
        return True
    return isinstance(error, KafkaError) and bool(getattr(error, "retriable", False))


class TopicAdmin:
    def __init__(self, bootstrap_servers: str, kafka: KafkaSettings) -> None:
        self._admin = AIOKafkaAdminClient(
            bootstrap_servers=bootstrap_servers,
            request_timeout_ms=kafka.request_timeout_ms,
            client_id=f"{kafka.client_id}-admin",
            **kafka.client_options(),
        )
        self._replication_factor = kafka.replication_factor
        self._policy: ReplyTopicSettings = kafka.reply_topics
        self._bucket = TokenBucket(
            self._policy.max_creations_per_s, self._policy.max_creation_burst
        )
        self._num_created_reply_topics = 0
        self._known: set[str] = set()
        self._num_partitions: dict[str, int] = {}  # asked of the broker when a request needs it
        self._creating: dict[str, asyncio.Future] = {}

    async def start(self) -> None:
        await self._admin.start()
        self._known.update(await self._admin.list_topics())

    async def close(self) -> None:
        for pending in list(self._creating.values()):
            pending.cancel()
        await self._admin.close()

    def is_known(self, name: str, partition: int | None = None) -> bool:
        """`name` exists, and so does its `partition` when one is named (v1.2)."""
        if name not in self._known:
            return False
        return partition is None or partition < self._num_partitions.get(name, 0)

    async def create(self, topics: dict[str, int]) -> None:
        """Create `{name: num_partitions}` that are not known to exist yet."""
        missing = {name: n for name, n in topics.items() if name not in self._known}
        for name in await create_topics(self._admin, missing, self._replication_factor):
            log.info("topic.created", topic=name, num_partitions=missing[name])
        self._known.update(missing)

    async def refresh(self, own_topics: dict[str, int]) -> None:
        """Forget topics that vanished and recreate the worker's own: a restarted embedded broker
        comes back empty, and reply topics must then be created again too."""
        self._known = set(await self._admin.list_topics())
        self._num_partitions = {n: k for n, k in self._num_partitions.items() if n in self._known}
        await self.create(own_topics)

    async def ensure_reply_topic(self, name: str, partition: int | None = None) -> None:
        """Make sure `name` (and its `partition`, if named) exists: asks the broker first, and
        creates the topic only when it is missing, once even when many requests name it at once.
        Raises `TopicCreationRefused`, or the broker's error after the retries."""
        if self.is_known(name, partition):
            return
        pending = self._creating.get(name)
        if pending is None:
            pending = asyncio.ensure_future(self._check_or_create(name))
            self._creating[name] = pending
            pending.add_done_callback(lambda _: self._creating.pop(name, None))
        await asyncio.shield(pending)
        if not self.is_known(name, partition):
            raise TopicCreationRefused(
                f"reply topic {name!r} has {self._num_partitions[name]} partitions, "
                f"not a partition {partition}"
            )

    async def _check_or_create(self, name: str) -> None:
        """Metadata before CreateTopics: a topic that exists (created by a client, by ops, or by
        another worker since the last refresh) costs no creation budget and is never refused."""
        num_partitions = await self._with_retries(lambda: num_partitions_of(self._admin, name))
        if num_partitions is None:
            self._admit_creation(name)
            created = await self._with_retries(
                lambda: create_topics(
                    self._admin, {name: NUM_REPLY_TOPIC_PARTITIONS}, self._replication_factor
                )
            )
            if name in created:
                log.info("topic.created", topic=name, num_partitions=NUM_REPLY_TOPIC_PARTITIONS)
                num_partitions = NUM_REPLY_TOPIC_PARTITIONS
            else:  # someone else created it in between: not ours to count
                self._num_created_reply_topics -= 1
                num_partitions = await self._with_retries(
                    lambda: num_partitions_of(self._admin, name)
                )
        self._known.add(name)
        self._num_partitions[name] = num_partitions or 0

    def _admit_creation(self, name: str) -> None:
        policy = self._policy
        if not policy.create:
            raise TopicCreationRefused(
                f"reply topic {name!r} does not exist, and reply topics are pre-provisioned "
                "only on this worker"
            )
        if self._num_created_reply_topics >= policy.max_created:
            raise TopicCreationRefused(
                f"this worker has created its limit of {policy.max_created} reply topics"
            )
        if not self._bucket.take():
            raise TopicCreationRefused(
                f"reply topics are being created faster than {policy.max_creations_per_s}/s"
            )
        self._num_created_reply_topics += 1

    async def _with_retries(self, call: Callable[[], Awaitable[T]]) -> T:
        delay_s = self._policy.retry_backoff_s
        for num_tries in range(1, self._policy.num_retries + 2):
            try:
                return await call()
            except (TimeoutError, KafkaError, OSError) as error:
                if not is_transient(error) or num_tries > self._policy.num_retries:
                    raise
                log.warning("topic.admin_retry", num_tries=num_tries, error=repr(error))
                await asyncio.sleep(delay_s)
                delay_s *= 2
        raise AssertionError("unreachable: the last try returns or raises")
