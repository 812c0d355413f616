"""What the client hands back: update results, OpenAI-shaped context, and the request
helpers the sync and asyncio clients share."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

from google.protobuf import json_format

from . import builders, pb

__all__ = ["UpdateResult", "openai_messages", "recall_tool_dict"]

LimitsLike = Union[pb.ModelLimits, Mapping[str, int], Tuple[int, ...], None]
ModelLike = Union[pb.ModelRef, Tuple[str, str], None]


@dataclass
class UpdateResult:
    """The outcome of one applied update: its ack and the events it caused.

    On the ``Stream`` RPC ``seq`` is the update's sequence number; the unary twins
    (``UpsertPart`` ...) report 0. ``events`` are the events that came before the ack
    (overflow, pruned, context, prune_report, overflow_check), in order.
    """

    seq: int
    kind: str
    created: bool
    events: List[pb.ServerEvent] = field(default_factory=list)

    def _first(self, name: str):
        for ev in self.events:
            if ev.WhichOneof("event") == name:
                return getattr(ev, name)
        return None

    @property
    def overflow(self) -> Optional[pb.OverflowCheck]:
        """The overflow report this update raised (the session crossed its threshold)."""
        return self._first("overflow")

    @property
    def pruned(self) -> Optional[pb.PruneReport]:
        """The automatic prune this update triggered, if it marked anything."""
        return self._first("pruned")

    @property
    def context(self) -> Optional[pb.Context]:
        """The context, for a ``get_context`` update."""
        return self._first("context")

    @property
    def prune_report(self) -> Optional[pb.PruneReport]:
        """The report of a ``prune`` update."""
        return self._first("prune_report")

    @property
    def overflow_check(self) -> Optional[pb.OverflowCheck]:
        """The decision of a ``check_overflow`` update."""
        return self._first("overflow_check")

    @classmethod
    def from_events(cls, events: Sequence[pb.ServerEvent], seq: int = 0) -> "UpdateResult":
        """Builds a result from a unary ``UpdateResponse``'s events (the ack comes last)."""
        kind, created, before = "", False, []
        for ev in events:
            if ev.WhichOneof("event") == "ack":
                kind, created = ev.ack.kind, ev.ack.created
            else:
                before.append(ev)
        return cls(seq=seq, kind=kind, created=created, events=before)


def openai_messages(context: pb.Context) -> List[Dict[str, Any]]:
    """The context as OpenAI chat-completions ``messages``: plain dicts and lists, ready
    for ``client.chat.completions.create(messages=...)`` or a JSON request body. Reads
    ``openai_messages_json`` (``CONTEXT_FORMAT_OPENAI_JSON``) when set, else the protobuf
    ``openai_messages``."""
    if context.openai_messages_json:
        return json.loads(context.openai_messages_json)
    if not context.HasField("openai_messages"):
        return []
    return json_format.MessageToDict(context.openai_messages)


def recall_tool_dict(tool: pb.RecallTool) -> Dict[str, Any]:
    """The ``compactd_recall`` tool as an OpenAI tool dict (``{"type": "function", ...}``)."""
    return json.loads(tool.json)


# Request helpers shared by Client and AsyncClient.


def as_limits(value: LimitsLike) -> Optional[pb.ModelLimits]:
    """Accepts ``pb.ModelLimits``, ``{"context": .., "output": ..}`` or ``(context, output)``."""
    if value is None or isinstance(value, pb.ModelLimits):
        return value
    if isinstance(value, Mapping):
        return pb.ModelLimits(**value)
    return builders.limits(*value)


def as_model(value: ModelLike) -> Optional[pb.ModelRef]:
    """Accepts ``pb.ModelRef`` or ``(provider_id, model_id)``."""
    if value is None or isinstance(value, pb.ModelRef):
        return value
    provider, model = value
    return builders.model_ref(provider, model)


def open_info(
    session_id: str,
    title: str,
    model: ModelLike,
    limits: LimitsLike,
    config: builders.Config,
    todos: Sequence[pb.Todo],
) -> pb.SessionInfo:
    """The SessionInfo an open (or reconfigure) sends."""
    return builders.session_info(
        session_id,
        title=title,
        model=as_model(model),
        limits=as_limits(limits),
        config=config,
        todos=todos,
    )


def import_request(
    export: Union[str, bytes, Mapping[str, Any]],
    session_id: str,
    limits: LimitsLike,
    config: builders.Config,
    replace: bool,
    keep_compactions: bool = False,
) -> pb.ImportSessionRequest:
    """An ImportSession request from an ``opencode export`` document (text or dict)."""
    req = pb.ImportSessionRequest(
        session_id=session_id, replace=replace, keep_compactions=keep_compactions
    )
    if isinstance(export, (str, bytes)):
        req.export_json = export.decode() if isinstance(export, bytes) else export
    else:
        req.export.update(dict(export))
    lim = as_limits(limits)
    if lim is not None:
        req.limits.CopyFrom(lim)
    if config is not None:
        req.config.CopyFrom(builders.session_config(config))
    return req


IMPORT_CHUNK_BYTES = 960 * 1024
"""An import past this many bytes goes in chunks of this size (ImportSessionChunked): one
ImportSession request may be at most compactd's ``max_update_bytes`` (16 MiB by default),
and a chunk under 1 MiB decodes outside the server's few slots for large requests."""


def import_text(export: Union[str, bytes, Mapping[str, Any]], chunk_bytes: int) -> Optional[bytes]:
    """The document as JSON text when it is over ``chunk_bytes`` (0: never), so it goes
    in chunks; None when it goes whole, in one ImportSession."""
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 0:
        raise ValueError(f"chunk_bytes must be a whole number of bytes >= 0, not {chunk_bytes!r}")
    if chunk_bytes == 0:
        return None
    if isinstance(export, bytes):
        text = export
    elif isinstance(export, str):
        text = export.encode()
    else:
        text = json.dumps(dict(export), ensure_ascii=False, separators=(",", ":")).encode()
    return text if len(text) > chunk_bytes else None


def import_chunks(
    text: bytes, head: pb.ImportSessionRequest, chunk_bytes: int
) -> Iterator[pb.ImportSessionChunk]:
    """An ImportSessionChunked call's chunks: ``head`` (a request without its document)
    rides on the first, and ``text`` is cut every ``chunk_bytes``."""
    view = memoryview(text)
    for at in range(0, len(text), chunk_bytes):
        chunk = pb.ImportSessionChunk(export_json=bytes(view[at : at + chunk_bytes]))
        if at == 0:
            chunk.request.CopyFrom(head)
        yield chunk


def compact_options(
    instructions: str,
    prompt: str,
    system: str,
    template: str,
    model: str,
    tail_turns: Optional[int],
) -> pb.CompactOptions:
    """The options of a manual compaction."""
    opts = pb.CompactOptions(
        instructions=instructions, prompt=prompt, system=system, template=template, model=model
    )
    if tail_turns is not None:
        opts.tail_turns = tail_turns
    return opts


def pin_fields(message_id: str, part_id: str, pinned: bool) -> Dict[str, Any]:
    """The fields of a pin request or update."""
    return {"message_id": message_id, "part_id": part_id, "pinned": pinned}


def list_sessions_request(page_size: int, page_token: str) -> pb.ListSessionsRequest:
    """One ListSessions page's request; ``page_size`` an integer from 1 to 2**31 - 1."""
    if isinstance(page_size, bool) or not isinstance(page_size, int) or not 1 <= page_size <= 2**31 - 1:
        raise ValueError(f"page_size must be an integer from 1 to 2**31 - 1, not {page_size!r}")
    return pb.ListSessionsRequest(page_size=page_size, page_token=page_token)


def next_page_token(token: str, reply: pb.ListSessionsResponse) -> Optional[str]:
    """The token of the page after ``reply`` (asked with ``token``); None after the last.
    A token that does not move past the last (a broken proxy) would loop: it raises."""
    if not reply.next_page_token:
        return None
    if reply.next_page_token <= token:
        raise RuntimeError(f"ListSessions page token did not advance ({reply.next_page_token!r})")
    return reply.next_page_token


def recall_request(session_id: str, call_id: Optional[str], part_id: Optional[str]) -> pb.RecallRequest:
    """A Recall request by exactly one of ``call_id`` or ``part_id``."""
    if (call_id is None) == (part_id is None):
        raise ValueError("recall needs exactly one of call_id or part_id")
    if call_id is not None:
        return pb.RecallRequest(session_id=session_id, call_id=call_id)
    return pb.RecallRequest(session_id=session_id, part_id=part_id)
