"""Topic administration: the worker's own topics at start-up, reply topics on first use.

The worker creates what it needs instead of relying on broker auto-creation: auto-created topics
get the broker's default partition count (4 on the embedded broker, 1 on Kafka), and the embedded
broker forgets every topic when it restarts.
"""

from __future__ import annotations

import asyncio

import structlog
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import for_code

from worker.settings import KafkaSettings

log = structlog.get_logger(__name__)

TOPIC_ALREADY_EXISTS = 36
NUM_REPLY_TOPIC_PARTITIONS = 1  # one client reads it; one partition keeps every reply in order


class TopicAdmin:
    def __init__(self, bootstrap_servers: str, kafka: KafkaSettings) -> None:
        self._admin = AIOKafkaAdminClient(
            bootstrap_servers=bootstrap_servers,
            request_timeout_ms=kafka.request_timeout_ms,
            client_id=f"{kafka.client_id}-admin",
            **kafka.client_options(),
        )
        self._replication_factor = kafka.replication_factor
        self._known: set[str] = set()
        self._creating: dict[str, asyncio.Future] = {}

    async def start(self) -> None:
        await self._admin.start()
        self._known.update(await self._admin.list_topics())

    async def close(self) -> None:
        await self._admin.close()

    async def create(self, topics: dict[str, int]) -> None:
        """Create `{name: num_partitions}`; a topic that already exists is fine (error 36)."""
        missing = {name: n for name, n in topics.items() if name not in self._known}
        if not missing:
            return
        response = await self._admin.create_topics(
            [NewTopic(name, n, self._replication_factor) for name, n in missing.items()]
        )
        for name, error_code, error_message in response.topic_errors:
            if error_code not in (0, TOPIC_ALREADY_EXISTS):
                raise for_code(error_code)(f"cannot create topic {name!r}: {error_message}")
            if error_code == 0:
                log.info("topic.created", topic=name, num_partitions=missing[name])
            self._known.add(name)

    async def refresh(self, own_topics: dict[str, int]) -> None:
        """Forget topics that vanished and recreate the worker's own: a restarted embedded broker
        comes back empty, and reply topics must then be created again too."""
        self._known = set(await self._admin.list_topics())
        await self.create(own_topics)

    async def ensure_reply_topic(self, name: str) -> None:
        """Make sure `name` exists, creating it once even when many requests name it at once."""
        if name in self._known:
            return
        pending = self._creating.get(name)
        if pending is None:
            pending = asyncio.ensure_future(self.create({name: NUM_REPLY_TOPIC_PARTITIONS}))
            self._creating[name] = pending
            pending.add_done_callback(lambda _: self._creating.pop(name, None))
        await asyncio.shield(pending)
