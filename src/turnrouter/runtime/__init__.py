"""The runtime path: typed topics and messages, and an in-process runtime.

Configure `AgentRouter(query_topic=..., output_topic=..., ...)` with `Topic`s carrying
exactly these payload classes, register `router.runtime_subscriber()` with an
`AgentRuntime`, and publish `UserQuery` messages. The in-process runtime needs nothing
beyond turnrouter's own dependencies; the `turnrouter[runtime]` extra is kept for
deployments that bring a networked runtime.
"""

from ._messages import (
    Interrupted,
    ParticipantJoined,
    ParticipantLeft,
    ResponseOutput,
    RuntimeMessage,
    UserQuery,
)
from ._runtime import AgentRuntime, RuntimeAgent, Topic
from ._subscriber import RouterSubscriber, validate_topics

__all__ = [
    "AgentRuntime",
    "Interrupted",
    "ParticipantJoined",
    "ParticipantLeft",
    "ResponseOutput",
    "RouterSubscriber",
    "RuntimeAgent",
    "RuntimeMessage",
    "Topic",
    "UserQuery",
    "validate_topics",
]
