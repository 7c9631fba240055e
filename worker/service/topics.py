"""Topic administration: the worker's own topics at start-up, reply topics on first use.

The worker creates what it needs instead of relying on broker auto-creation: auto-created topics
get the broker's default partition count (4 on the embedded broker, 1 on Kafka), and the embedded
broker forgets every topic when it restarts.
"""

from __future__ import annotations

import asyncio

import structlog
from aiokafka.admin import AIOKafkaAdminClient

from schemas.contract import NUM_REPLY_TOPIC_PARTITIONS
from worker.service.settings import KafkaSettings
from worker.topics import create_topics

log = structlog.get_logger(__name__)



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
        """Make sure `name` exists, creating it once even when many requests name it at once."""
        if name in self._known:
            return
        pending = self._creating.get(name)
        if pending is None:
            pending = asyncio.ensure_future(self.create({name: NUM_REPLY_TOPIC_PARTITIONS}))
            self._creating[name] = pending
            pending.add_done_callback(lambda _: self._creating.pop(name, None))
        await asyncio.shield(pending)
