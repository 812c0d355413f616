"""The blocking client: every RPC of ``compactd.v1.Sessions`` as a typed method."""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import grpc

from . import builders, pb
from .compaction import Compaction, cancelled_here
from .errors import CompactdError, error_from_rpc
from .results import (
    LimitsLike,
    ModelLike,
    UpdateResult,
    compact_options,
    IMPORT_CHUNK_BYTES,
    import_chunks,
    import_request,
    import_text,
    open_info,
    openai_messages,
    pin_fields,
    list_sessions_request,
    next_page_token,
    recall_request,
    recall_tool_dict,
)
from .stream import DEFAULT_MAX_UPDATE_BYTES, SessionStream

__all__ = ["Client", "Subscription", "channel_options", "with_channel_defaults"]

# gRPC's default receive limit is 4 MiB; a long session read with GetSession is larger
# (a session may hold up to compactd's max_session_bytes, 256 MiB by default). The
# TypeScript client's default too.
DEFAULT_MAX_MESSAGE_BYTES = 512 * 1024 * 1024

# Seconds a unary call may take by default (the TypeScript client's default too): a
# server that stops answering must not hold the caller forever.
DEFAULT_TIMEOUT = 30.0


# While calls are open, the channel pings every KEEPALIVE_MS and gives the server
# KEEPALIVE_TIMEOUT_MS to answer: a call with no deadline (a Subscribe, a compaction)
# to a compactd that stopped answering without closing the connection (hung, stopped,
# across a network partition) ends UNAVAILABLE within ~30 s instead of when TCP gives up.
KEEPALIVE_MS = 20_000
KEEPALIVE_TIMEOUT_MS = 10_000


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> List[Tuple[str, Any]]:
    """Channel options the clients use: larger message limits than gRPC's 4 MiB, and
    keepalive pings while calls are open (a silent server ends them)."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        # gRPC core (1.85 here) times a keepalive ping out after ping_timeout_ms (a
        # minute by default), whatever keepalive_timeout_ms says.
        ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        # gRPC core stops pinging after two pings on a call that sends nothing (a
        # Subscribe): 0 keeps pinging for as long as the call is open.
        ("grpc.http2.max_pings_without_data", 0),
    ]


def with_channel_defaults(options: Optional[Sequence[Tuple[str, Any]]]) -> List[Tuple[str, Any]]:
    """``options`` over :func:`channel_options`: a caller's own option (a keepalive, a
    proxy) keeps the larger message limits unless it sets them itself. Before, any
    ``options`` replaced them, and a context past gRPC's 4 MiB failed on the client."""
    merged = dict(channel_options())
    merged.update(options or ())
    return list(merged.items())


def auth_metadata(token: Optional[str]) -> Tuple[Tuple[str, str], ...]:
    """The ``authorization: Bearer`` header for a server started with an auth token.

    The token is read as the server reads its file: without surrounding whitespace (a
    file's or a secret's newline). One an HTTP/2 header cannot carry (control or non-ASCII
    characters) is refused here with a ``ValueError`` that does not show it; grpcio would
    fail every call with ``INTERNAL: Invalid metadata``.
    """
    token = token.strip() if token else ""
    if not token:
        return ()
    if not all(" " <= ch <= "~" for ch in token):
        raise ValueError(
            "token holds characters an HTTP header cannot carry (control or non-ASCII); "
            "its value is not shown"
        )
    return (("authorization", f"Bearer {token}"),)


class Subscription:
    """A ``Subscribe`` watch: iterate it for ``pb.SessionEvent`` (overflow, pruned,
    compaction, evicted) until :meth:`cancel` or the server ends it."""

    def __init__(self, call) -> None:
        self._call = call
        self._cancelled = False

    def __iter__(self) -> Iterator[pb.SessionEvent]:
        try:
            for ev in self._call:
                yield ev
        except grpc.RpcError as e:
            if self._cancelled and e.code() == grpc.StatusCode.CANCELLED:
                return
            raise error_from_rpc(e) from None

    def cancel(self) -> None:
        """Stops watching."""
        self._cancelled = True
        self._call.cancel()

    def __enter__(self) -> "Subscription":
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()


class Client:
    """A blocking compactd client over one gRPC channel.

    >>> with Client("127.0.0.1:50051") as c:
    ...     c.open_session("s1", limits=(128_000, 8_000))

    Args:
        target: ``host:port`` or ``unix:/path/to.sock``.
        token: bearer token, for a server started with ``--auth-token-file``.
        credentials: ``grpc.ssl_channel_credentials(...)`` for a TLS server; plaintext
            without it.
        timeout: deadline in seconds of each unary call (default 30, as the TypeScript
            client; None: none, and a server that stops answering holds the call
            forever).
        channel: an existing channel to use instead of opening one (``target`` ignored).
        options: gRPC channel options, over :func:`channel_options` (an option given
            here wins; the larger message limits stay unless set here).
        max_update_bytes: the largest update a stream sends (default 16 MiB, compactd's
            default ``--max-update-bytes``; set it to the server's). One larger raises
            ResourceExhausted and is not sent: the server would end the whole stream on
            it. None: no check.
    """

    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        *,
        token: Optional[str] = None,
        credentials: Optional[grpc.ChannelCredentials] = None,
        timeout: Optional[float] = DEFAULT_TIMEOUT,
        channel: Optional[grpc.Channel] = None,
        options: Optional[Sequence[Tuple[str, Any]]] = None,
        max_update_bytes: Optional[int] = DEFAULT_MAX_UPDATE_BYTES,
    ) -> None:
        # Checked first: a refused token opens no channel.
        self._md = auth_metadata(token)
        opts = with_channel_defaults(options)
        if channel is not None:
            self._channel, self._own = channel, False
        elif credentials is not None:
            self._channel, self._own = grpc.secure_channel(target, credentials, opts), True
        else:
            self._channel, self._own = grpc.insecure_channel(target, opts), True
        self.stub = pb.SessionsStub(self._channel)
        self._timeout = timeout
        self._max_update_bytes = max_update_bytes

    # Plumbing.

    def with_timeout(self, timeout: Optional[float]) -> "Client":
        """This client with another deadline for its unary calls (seconds; None: none),
        sharing the channel: ``c.with_timeout(300).import_session(doc)``. Closing the
        copy leaves the channel open."""
        other = copy.copy(self)
        other._own = False
        other._timeout = timeout
        return other

    def _unary(self, method: Callable, request):
        try:
            return method(request, metadata=self._md, timeout=self._timeout)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None

    def close(self) -> None:
        """Closes the channel (when this client opened it)."""
        if self._own:
            self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Blocks until the channel is connected, or raises CompactdError (UNAVAILABLE)."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise CompactdError(
                grpc.StatusCode.UNAVAILABLE, f"compactd not reachable within {timeout}s"
            ) from None

    # The main path.

    def stream(self, on_event: Optional[Callable[[pb.ServerEvent], None]] = None) -> SessionStream:
        """Opens the bidirectional ``Stream``: updates with seq/ack handling.

        ``on_event`` receives events that arrive after their update's ack (the compaction
        events of an automatic compaction); without it they queue for
        :meth:`SessionStream.next_event`.
        """
        return SessionStream(
            self.stub, self._md, on_event=on_event, max_update_bytes=self._max_update_bytes
        )

    # Sessions.

    def open_session(
        self,
        session_id: str,
        *,
        title: str = "",
        model: ModelLike = None,
        limits: LimitsLike = None,
        config: builders.Config = None,
        todos: Sequence[pb.Todo] = (),
    ) -> pb.SessionSummary:
        """Opens a session, or reconfigures it (title, model, limits, config, todos).

        ``limits`` is ``(context, output)``, a dict or ``pb.ModelLimits``; ``config`` a
        dict of ``SessionConfig`` fields (``{"prune_protect": 2000}``) or the message;
        ``model`` ``(provider_id, model_id)``. ``summary.created`` tells a new session.
        """
        info = open_info(session_id, title, model, limits, config, todos)
        return self._unary(self.stub.OpenSession, pb.OpenSessionRequest(session=info))

    def get_session(self, session_id: str) -> pb.GetSessionResponse:
        """The whole session: info, every message and part (cleared outputs included)."""
        return self._unary(self.stub.GetSession, pb.GetSessionRequest(session_id=session_id))

    def list_sessions(self, *, page_size: int = 1000) -> List[pb.SessionSummary]:
        """One summary per session held, in id order (cold sessions give their id and
        ``cold``), fetched ``page_size`` at a time so no reply outgrows the receive limit
        (the call timeout applies to each page)."""
        sessions: List[pb.SessionSummary] = []
        token: Optional[str] = ""
        while token is not None:
            reply = self._unary(self.stub.ListSessions, list_sessions_request(page_size, token))
            sessions.extend(reply.sessions)
            token = next_page_token(token, reply)
        return sessions

    def delete_session(self, session_id: str) -> bool:
        """Forgets a session; True when it existed."""
        reply = self._unary(self.stub.DeleteSession, pb.DeleteSessionRequest(session_id=session_id))
        return reply.deleted

    def import_session(
        self,
        export: Union[str, bytes, Mapping[str, Any]],
        *,
        session_id: str = "",
        limits: LimitsLike = None,
        config: builders.Config = None,
        replace: bool = False,
        keep_compactions: bool = False,
        chunk_bytes: int = IMPORT_CHUNK_BYTES,
    ) -> pb.SessionSummary:
        """Loads an ``opencode export`` document (JSON text or a dict) as a session.

        With ``replace`` and ``keep_compactions``, the compactions compactd committed on
        the replaced session (absent from a host's own history) are kept; one committed
        while the document was built fails the call with ABORTED (import again: it is
        kept then). A document past
        ``chunk_bytes`` (960 KiB; 0: never) is sent in chunks of that size, so one longer
        than compactd's ``max_update_bytes`` imports too (whole, to a compactd without
        ImportSessionChunked).
        """
        text = import_text(export, chunk_bytes)
        if text is not None:
            head = import_request("", session_id, limits, config, replace, keep_compactions)
            try:
                return self._unary(
                    self.stub.ImportSessionChunked, import_chunks(text, head, chunk_bytes)
                )
            except CompactdError as e:
                if e.code != grpc.StatusCode.UNIMPLEMENTED:
                    raise
        req = import_request(export, session_id, limits, config, replace, keep_compactions)
        return self._unary(self.stub.ImportSession, req)

    # Unary twins of the stream updates.

    def upsert_message(self, session_id: str, message: pb.MessageInfo) -> UpdateResult:
        """Inserts a message or updates it in place (see :mod:`compactd_client.builders`)."""
        req = pb.UpsertMessageRequest(session_id=session_id, message=message)
        return UpdateResult.from_events(self._unary(self.stub.UpsertMessage, req).events)

    def upsert_part(self, session_id: str, part: pb.Part) -> UpdateResult:
        """Inserts a part or updates it in place; its message must exist."""
        req = pb.UpsertPartRequest(session_id=session_id, part=part)
        return UpdateResult.from_events(self._unary(self.stub.UpsertPart, req).events)

    def delete_part(self, session_id: str, message_id: str, part_id: str) -> UpdateResult:
        """Removes a part."""
        req = pb.DeletePartRequest(session_id=session_id, message_id=message_id, part_id=part_id)
        return UpdateResult.from_events(self._unary(self.stub.DeletePart, req).events)

    def report_usage(
        self, session_id: str, tokens: pb.TokenUsage, message_id: str = ""
    ) -> UpdateResult:
        """Records the provider's usage of the latest request and checks overflow."""
        usage = pb.UsageReport(message_id=message_id, tokens=tokens)
        req = pb.ReportUsageRequest(session_id=session_id, usage=usage)
        return UpdateResult.from_events(self._unary(self.stub.ReportUsage, req).events)

    def pin(
        self, session_id: str, message_id: str, part_id: str = "", *, pinned: bool = True
    ) -> UpdateResult:
        """Pins (or with ``pinned=False`` unpins) a part, or a whole message."""
        req = pb.PinRequest(session_id=session_id, **pin_fields(message_id, part_id, pinned))
        return UpdateResult.from_events(self._unary(self.stub.Pin, req).events)

    # Reading the context and deciding.

    def get_context(
        self, session_id: str, format: "pb.ContextFormat" = pb.CONTEXT_FORMAT_UNSPECIFIED
    ) -> pb.Context:
        """The ready-to-send context (native and/or OpenAI shape, estimated tokens)."""
        req = pb.GetContextRequest(session_id=session_id, format=format)
        return self._unary(self.stub.GetContext, req)

    def openai_messages(self, session_id: str) -> List[Dict[str, Any]]:
        """The context as OpenAI chat ``messages`` (list of dicts), ready to send."""
        return openai_messages(self.get_context(session_id, pb.CONTEXT_FORMAT_OPENAI_JSON))

    def prune(self, session_id: str, *, dry_run: bool = False) -> pb.PruneReport:
        """Runs prune and the strategies now (or reports what they would do)."""
        return self._unary(self.stub.Prune, pb.PruneRequest(session_id=session_id, dry_run=dry_run))

    def check_overflow(self, session_id: str) -> pb.OverflowCheck:
        """The overflow decision with every number behind it."""
        return self._unary(self.stub.CheckOverflow, pb.CheckOverflowRequest(session_id=session_id))

    # Recall.

    def recall(
        self, session_id: str, *, call_id: Optional[str] = None, part_id: Optional[str] = None
    ) -> pb.Recalled:
        """A part's original content by tool ``call_id`` or ``part_id``."""
        return self._unary(self.stub.Recall, recall_request(session_id, call_id, part_id))

    def recall_tool(self) -> Dict[str, Any]:
        """The ``compactd_recall`` tool definition as an OpenAI tool dict."""
        return recall_tool_dict(self._unary(self.stub.GetRecallTool, pb.GetRecallToolRequest()))

    # Streams.

    def compact(
        self,
        session_id: str,
        *,
        instructions: str = "",
        prompt: str = "",
        system: str = "",
        template: str = "",
        model: str = "",
        tail_turns: Optional[int] = None,
    ) -> Compaction:
        """Starts a manual compaction; iterate the result for its events (``deltas()``
        for the summary text, ``wait()`` for ``session.compacted``). A refusal (no LLM
        configured, one already running) raises CompactdError when iteration starts."""
        opts = compact_options(instructions, prompt, system, template, model, tail_turns)
        call = self.stub.Compact(
            pb.CompactRequest(session_id=session_id, options=opts), metadata=self._md
        )
        cancelled = []

        def events() -> Iterator[pb.CompactionEvent]:
            try:
                yield from call
            except grpc.RpcError as e:
                if cancelled and e.code() == grpc.StatusCode.CANCELLED:
                    yield cancelled_here(session_id)
                    return
                raise error_from_rpc(e) from None

        def cancel() -> None:
            cancelled.append(True)
            call.cancel()

        return Compaction(events(), cancel)

    def subscribe(self, session_id: str = "") -> Subscription:
        """Watches one session (or all with ``""``). Returns once the server has
        registered the watcher, so no later event is missed; an unknown session raises
        NotFound here."""
        call = self.stub.Subscribe(pb.SubscribeRequest(session_id=session_id), metadata=self._md)
        try:
            call.initial_metadata()  # sent once the watcher is on the bus
            if call.done() and call.code() != grpc.StatusCode.OK:
                raise error_from_rpc(call)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None
        return Subscription(call)
