"""Topic creation shared by the worker and the client SDK (aiokafka only, no torch).

Both create topics explicitly rather than rely on auto-creation: auto-created topics get the
broker's default partition count (4 on the embedded broker, 1 on Kafka), and a reply topic must
have exactly one partition so its replies stay in order.
"""

from __future__ import annotations

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import for_code

from schemas.contract import KAFKA_TOPIC_ALREADY_EXISTS


async def create_topics(
    admin: AIOKafkaAdminClient, topics: dict[str, int], replication_factor: int
) -> list[str]:
    """Create `{name: num_partitions}`. A topic that already exists counts as success.

    Returns the names this call created. Raises the broker's error for any other failure."""
    if not topics:
        return []
    response = await admin.create_topics(
        [NewTopic(name, n, replication_factor) for name, n in topics.items()]
    )
    created = []
    for entry in response.topic_errors:
        name, error_code, error_message = entry[0], entry[1], entry[2] if len(entry) > 2 else ""
        if error_code not in (0, KAFKA_TOPIC_ALREADY_EXISTS):
            raise for_code(error_code)(f"cannot create topic {name!r}: {error_message}")
        if error_code == 0:
            created.append(name)
    return created
