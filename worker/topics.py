"""Topic creation shared by the worker and the client SDK (aiokafka only, no torch).

Both create topics explicitly rather than rely on auto-creation: auto-created topics get the
broker's default partition count (4 on the embedded broker, 1 on Kafka), and a per-client reply
topic must have exactly one partition so its replies stay in order.

Asking whether a topic exists must not create it: Apache Kafka's `auto.create.topics.enable`
(on by default) creates a topic a Metadata request names unless the request says not to, and
aiokafka's `describe_topics` never says so. `num_partitions_of` does.
"""

from __future__ import annotations

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import UnknownTopicOrPartitionError, for_code
from aiokafka.protocol.metadata import MetadataRequest

from schemas.contract import KAFKA_TOPIC_ALREADY_EXISTS


async def num_partitions_of(admin: AIOKafkaAdminClient, name: str) -> int | None:
    """How many partitions topic `name` has; None if it does not exist (it is not created)."""
    request = MetadataRequest([name], allow_auto_topic_creation=False)
    response = await admin._send_request(request)  # no public call sends the flag
    for topic in response.to_object()["topics"]:
        if topic["topic"] != name:
            continue
        if topic["error_code"] == UnknownTopicOrPartitionError.errno:
            return None
        if topic["error_code"] != 0:
            raise for_code(topic["error_code"])(f"cannot describe topic {name!r}")
        return len(topic["partitions"])
    return None


async def delete_topic(admin: AIOKafkaAdminClient, name: str) -> None:
    """Delete `name`; one that is already gone counts as success."""
    response = await admin.delete_topics([name])
    for entry in response.topic_error_codes:
        error_code = entry[1]
        if error_code not in (0, UnknownTopicOrPartitionError.errno):
            raise for_code(error_code)(f"cannot delete topic {entry[0]!r}")


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
