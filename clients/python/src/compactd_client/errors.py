"""Errors compactd reports, as exceptions carrying the gRPC code and the field at fault.

compactd reports a rejected request in one of two ways:

* a unary call (and the opening of a streaming call) fails with a gRPC status whose
  message reads ``"<field>: <message>"`` when a field is to blame
  (``"part.message_id: message m9 does not exist; upsert the message first"``);
* an update on the ``Stream`` RPC gets an ``error`` event with ``code`` (the status code's
  name, ``"NOT_FOUND"``), ``message`` and ``field`` (dotted, under the update's oneof
  name: ``"upsert_part.message_id"``), and the stream stays open.

Both become a :class:`CompactdError` (or the subclass for its code, such as
:class:`NotFound`), so ``except compactd_client.NotFound`` works for either path.
"""

from __future__ import annotations

import re
from typing import Dict, Optional, Type

import grpc

__all__ = [
    "CompactdError",
    "InvalidArgument",
    "NotFound",
    "AlreadyExists",
    "FailedPrecondition",
    "PermissionDenied",
    "ResourceExhausted",
    "Unavailable",
    "Unauthenticated",
    "CompactionFailed",
    "error_from_rpc",
    "error_from_event",
]

# "<field>: <message>", the field a dotted path without spaces or colons ("session.id",
# "export.messages[3].info.role", an import's JSON path "export_json.$.messages[2].my-key"),
# as the TypeScript client reads it. A message without a field never starts so:
# compactd's field-less messages begin with plain words.
_FIELD_PREFIX = re.compile(r"^([A-Za-z_][^\s:]*): (.*)$", re.S)


class CompactdError(Exception):
    """A request compactd refused (or a transport failure on the way to it).

    Attributes:
        code: the gRPC status code (``grpc.StatusCode.NOT_FOUND``).
        code_name: its name as compactd spells it (``"NOT_FOUND"``).
        message: the human message, without the field prefix.
        field: the offending field, dotted (``"part.tool.state.status"``), or ``""``.
        seq: the stream update's ``seq`` for errors from ``Stream``, else ``None``.
        stream_ended: True when the stream ended before this update's ack or error: the
            code is the stream's, not a refusal of this update, and whether it was applied
            is unknown (``get_session`` shows the session); or, with ``seq`` None, when
            the stream had ended before this update was sent (it was not).
    """

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        field: str = "",
        seq: Optional[int] = None,
    ) -> None:
        self.code = code
        self.code_name = code.name
        self.message = message
        self.field = field
        self.seq = seq
        self.stream_ended = False
        where = f" [{field}]" if field else ""
        super().__init__(f"{code.name}{where}: {message}")


class InvalidArgument(CompactdError):
    """A missing or malformed field (``INVALID_ARGUMENT``)."""


class NotFound(CompactdError):
    """An unknown session, message, part or call id (``NOT_FOUND``)."""


class AlreadyExists(CompactdError):
    """An import over an existing session without ``replace`` (``ALREADY_EXISTS``)."""


class FailedPrecondition(CompactdError):
    """A part for a message that does not exist, a role change, compaction not
    configured or already running (``FAILED_PRECONDITION``)."""


class PermissionDenied(CompactdError):
    """A compaction model outside ``--compaction-allowed-models`` (``PERMISSION_DENIED``)."""


class ResourceExhausted(CompactdError):
    """An update over a size or memory limit, a slow reader (``RESOURCE_EXHAUSTED``)."""


class Unavailable(CompactdError):
    """The server is unreachable, draining or its store is failing (``UNAVAILABLE``)."""


class Unauthenticated(CompactdError):
    """A missing or wrong bearer token (``UNAUTHENTICATED``)."""


class CompactionFailed(Exception):
    """A compaction ended with a ``failed`` event (not a refused request).

    Attributes:
        kind: what failed (``"request"``, ``"timeout"``, ``"cancelled"``, ...).
        reason: the server's explanation.
        retryable: trying again later may succeed.
        event: the ``CompactionFailed`` message itself.
    """

    def __init__(self, event) -> None:  # event: pb.CompactionFailed
        self.event = event
        self.kind: str = event.kind
        self.reason: str = event.reason
        self.retryable: bool = event.retryable
        super().__init__(f"compaction failed ({event.kind}): {event.reason}")


_BY_CODE: Dict[grpc.StatusCode, Type[CompactdError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
}
_BY_NAME: Dict[str, grpc.StatusCode] = {c.name: c for c in grpc.StatusCode}


def make_error(
    code: grpc.StatusCode, message: str, field: str = "", seq: Optional[int] = None
) -> CompactdError:
    """The :class:`CompactdError` subclass for ``code`` (the base class for other codes)."""
    return _BY_CODE.get(code, CompactdError)(code, message, field, seq)


def stream_ended(failure: CompactdError, seq: int) -> CompactdError:
    """The error of an update left unanswered when its stream ended with ``failure``:
    the stream's code (its class, so a caller catching it still does), with the update's
    seq, ``stream_ended`` set and a message saying its outcome is unknown."""
    err = make_error(
        failure.code,
        "the stream ended before this update's ack, so its outcome is unknown (get_session "
        f"shows the session): {failure.message}",
        failure.field,
        seq,
    )
    err.stream_ended = True
    return err


def after_stream_end(failure: CompactdError) -> CompactdError:
    """The error of an update sent after its stream ended with ``failure``: a new one
    per update (raising the stream's own error again would read as this update's
    refusal, and grow that error's traceback on every raise), with the stream's code,
    ``stream_ended`` set, no seq (the update was not sent) and the failure named."""
    where = f" [{failure.field}]" if failure.field else ""
    err = make_error(
        failure.code,
        "the stream ended earlier, so this update was not sent (open a new stream); it "
        f"ended with {failure.code_name}{where}: {failure.message}",
    )
    err.stream_ended = True
    return err


def split_field(details: str) -> "tuple[str, str]":
    """Splits a status message ``"field: message"`` into ``(field, message)``.

    A message with no field prefix comes back as ``("", details)``.
    """
    m = _FIELD_PREFIX.match(details or "")
    if m:
        return m.group(1), m.group(2)
    return "", details or ""


def error_from_rpc(err: grpc.RpcError) -> CompactdError:
    """Converts a failed call's ``grpc.RpcError`` (sync or aio) into a CompactdError."""
    code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN
    details = err.details() if callable(getattr(err, "details", None)) else str(err)
    field, message = split_field(details or "")
    return make_error(code or grpc.StatusCode.UNKNOWN, message, field)


def error_from_event(error, seq: int) -> CompactdError:
    """Converts a ``Stream`` ``error`` event (``pb.Error``) into a CompactdError."""
    code = _BY_NAME.get(error.code, grpc.StatusCode.UNKNOWN)
    return make_error(code, error.message, error.field, seq)
