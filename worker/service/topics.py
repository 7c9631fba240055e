"""Topic administration: the worker's own topics at start-up, reply topics on first use.

The worker creates what it needs instead of relying on broker auto-creation: auto-created topics
get the broker's default partition count (4 on the embedded broker, 1 on Kafka), and the embedded
broker forgets every topic when it restarts.

Reply topics are named by producers, so their creation is bounded by settings
(`kafka.reply_topics`): switched off (pre-provisioned topics only), a limit on how many one
worker creates in its life, and a rate (a token bucket). A request whose reply topic it may not
create is dead-lettered (`reply_topic_unavailable`). Transient CreateTopics failures (timeouts, a
broker mid-restart) are retried with backoff; only a refusal the broker means (invalid name,
not authorised, policy) or the last retry's failure gives up. Creation never blocks the poll
loop: the consumer awaits it out of line, for the one request that needs it.
"""

from __future__ import annotations

import asyncio
import time

import structlog
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from schemas.contract import NUM_REPLY_TOPIC_PARTITIONS
from worker.service.settings import KafkaSettings, ReplyTopicSettings
from worker.topics import create_topics

log = structlog.get_logger(__name__)


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
        self._creating: dict[str, asyncio.Future] = {}

    async def start(self) -> None:
        await self._admin.start()
        self._known.update(await self._admin.list_topics())

    async def close(self) -> None:
        for pending in list(self._creating.values()):
            pending.cancel()
        await self._admin.close()

    def is_known(self, name: str) -> bool:
        return name in self._known

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
        await self.create(own_topics)

    async def ensure_reply_topic(self, name: str) -> None:
        """Make sure `name` exists, creating it once even when many requests name it at once.
        Raises `TopicCreationRefused`, or the broker's error after the retries."""
        if name in self._known:
            return
        pending = self._creating.get(name)
        if pending is None:
            self._admit_creation(name)
            pending = asyncio.ensure_future(self._create_with_retries(name))
            self._creating[name] = pending
            pending.add_done_callback(lambda _: self._creating.pop(name, None))
        await asyncio.shield(pending)

    def _admit_creation(self, name: str) -> None:
        policy = self._policy
        if not policy.create:
            raise TopicCreationRefused("reply topics are pre-provisioned only on this worker")
        if self._num_created_reply_topics >= policy.max_created:
            raise TopicCreationRefused(
                f"this worker has created its limit of {policy.max_created} reply topics"
            )
        if not self._bucket.take():
            raise TopicCreationRefused(
                f"reply topics are being created faster than {policy.max_creations_per_s}/s"
            )
        self._num_created_reply_topics += 1

    async def _create_with_retries(self, name: str) -> None:
        delay_s = self._policy.retry_backoff_s
        for num_tries in range(1, self._policy.num_retries + 2):
            try:
                await self.create({name: NUM_REPLY_TOPIC_PARTITIONS})
                return
            except (TimeoutError, KafkaError, OSError) as error:
                if not is_transient(error) or num_tries > self._policy.num_retries:
                    raise
                log.warning("topic.create_retry", num_tries=num_tries, error=repr(error))
                await asyncio.sleep(delay_s)
                delay_s *= 2
