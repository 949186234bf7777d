"""turnrouter on NATS JetStream: many router replicas, one owner per partition.

Install `turnrouter[nats]`. Run replicas with `turnrouter worker --nats URL --app
module:factory` (or `NatsWorker`), publish with `NatsFrontEnd`. See docs/distributed.md.
"""

from ._client import NatsFrontEnd
from ._wire import MAX_PARTICIPANT_ID_BYTES, NatsConfig, decode_token, encode_token
from ._worker import NatsWorker, WorkerContext

__all__ = [
    "MAX_PARTICIPANT_ID_BYTES",
    "NatsConfig",
    "NatsFrontEnd",
    "NatsWorker",
    "WorkerContext",
    "decode_token",
    "encode_token",
]
