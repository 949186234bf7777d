"""turnrouter on NATS JetStream: many router replicas, one owner per partition.

Install `turnrouter[nats]`. Run replicas with `turnrouter worker --nats URL --app
module:factory` (or `NatsWorker`), publish with `NatsFrontEnd`. See docs/distributed.md.
`parse_state` reads a participant's record in the key-value bucket (`parse_record` all
of it, as a `StateRecord`; `state_json` writes one), to inspect what a deployment
holds; `parse_input` checks one input as a replica does (raising `Rejected` with the
reason it counts); `samples_body` and `parse_samples` are the fleet's timing-sample
messages, `parse_presence` checks a presence message as a replica does.
`NatsWorker.readiness` (a `Readiness`) says whether a worker serves now.
"""

try:
    import nats  # noqa: F401
except ImportError as exc:  # exercised in a test that hides nats-py
    raise ImportError(
        "turnrouter.runtime.nats needs nats-py: install turnrouter's nats extra "
        "(from a checkout: pip install -e '.[nats]')"
    ) from exc

from ._client import MAX_PUBLISHED, MAX_SEEN_FINALS, READER_PATIENCE, NatsFrontEnd
from ._connection import Readiness
from ._fleet import parse_presence
from ._security import MAX_CA_FILE_BYTES, MAX_SECRET_FILE_BYTES
from ._stall import STALL_SECS
from ._wire import (
    MAX_ENDED,
    MAX_PARTICIPANT_ID_BYTES,
    Ending,
    NatsConfig,
    Rejected,
    StateRecord,
    decode_token,
    encode_token,
    parse_input,
    parse_record,
    parse_samples,
    parse_state,
    samples_body,
    state_json,
)
from ._worker import NatsWorker, WorkerContext

__all__ = [
    "MAX_CA_FILE_BYTES",
    "MAX_ENDED",
    "MAX_PARTICIPANT_ID_BYTES",
    "MAX_PUBLISHED",
    "MAX_SECRET_FILE_BYTES",
    "MAX_SEEN_FINALS",
    "READER_PATIENCE",
    "STALL_SECS",
    "Ending",
    "NatsConfig",
    "NatsFrontEnd",
    "NatsWorker",
    "Readiness",
    "Rejected",
    "StateRecord",
    "WorkerContext",
    "decode_token",
    "encode_token",
    "parse_input",
    "parse_presence",
    "parse_record",
    "parse_samples",
    "parse_state",
    "samples_body",
    "state_json",
]
