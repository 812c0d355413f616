"""compactd_client: a typed Python client (blocking and asyncio) for compactd.

compactd is a gRPC sidecar that keeps an LLM agent's session inside its context window:
the host streams every message, part and usage report into it and sends the context it
returns. This package wraps ``compactd.v1.Sessions``:

* :class:`Client` / :class:`AsyncClient`: every RPC as a method;
* :class:`SessionStream` / :class:`AsyncSessionStream`: the ``Stream`` RPC with seq/ack
  handling (``client.stream()``);
* :mod:`compactd_client.builders`: short constructors for messages, parts and usage;
* :mod:`compactd_client.pb`: the generated protobuf messages;
* :class:`CompactdError` and its subclasses (``NotFound`` ...): refusals with the gRPC
  code and the field the server named.
"""

from . import builders, pb
from .aio import AsyncClient, AsyncSessionStream, AsyncSubscription
from .client import Client, Subscription
from .compaction import AsyncCompaction, Compaction
from .errors import (
    AlreadyExists,
    CompactdError,
    CompactionFailed,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from .results import UpdateResult, openai_messages
from .stream import SessionStream

__version__ = "0.1.0"

__all__ = [
    "AlreadyExists",
    "AsyncClient",
    "AsyncCompaction",
    "AsyncSessionStream",
    "AsyncSubscription",
    "Client",
    "CompactdError",
    "Compaction",
    "CompactionFailed",
    "FailedPrecondition",
    "InvalidArgument",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "SessionStream",
    "Subscription",
    "Unauthenticated",
    "Unavailable",
    "UpdateResult",
    "builders",
    "openai_messages",
    "pb",
]
