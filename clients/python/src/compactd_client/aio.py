"""The asyncio client (``grpc.aio``): the same methods as :class:`~compactd_client.Client`,
awaitable, with an async ``Stream`` whose updates await their ack."""

from __future__ import annotations

import asyncio
import copy
import logging
from collections import deque
from typing import Any, AsyncIterator, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import grpc
import grpc.aio

from . import builders, pb
from .client import DEFAULT_TIMEOUT, auth_metadata, with_channel_defaults
from .compaction import AsyncCompaction, cancelled_here
from .errors import (
    CompactdError,
    after_stream_end,
    error_from_event,
    error_from_rpc,
    make_error,
    split_field,
    stream_ended,
)
from .stream import DEFAULT_MAX_UPDATE_BYTES, LATE_EVENTS_KEPT, MAX_UNSENT, check_update_size, update_size
from .stream import _keep as _keep_bounded
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

__all__ = ["AsyncClient", "AsyncSessionStream", "AsyncSubscription"]

_CLOSE = object()
_END = object()

_log = logging.getLogger("compactd_client")


def _keep(q: "asyncio.Queue[Any]", item: Any) -> None:
    """:func:`compactd_client.stream._keep` for an ``asyncio.Queue``."""
    _keep_bounded(q, item, asyncio.QueueFull, asyncio.QueueEmpty)


def _closed_error(closed: List[bool]) -> Optional[CompactdError]:
    """What a call grpc.aio cancelled raises instead of ``asyncio.CancelledError``:
    CompactdError CANCELLED when its client was closed and the task itself was not
    cancelled (its owner would not expect CancelledError); None to re-raise it."""
    task = asyncio.current_task()
    own = task is not None and getattr(task, "cancelling", lambda: 0)() > 0
    if closed and not own:
        return make_error(grpc.StatusCode.CANCELLED, "the client was closed while the call was open")
    return None


class AsyncSubscription:
    """A ``Subscribe`` watch: ``async for event in sub`` until :meth:`cancel`."""

    def __init__(self, call: grpc.aio.UnaryStreamCall, closed: Optional[List[bool]] = None) -> None:
        self._call = call
        self._cancelled = False
        self._closed: List[bool] = closed if closed is not None else []

    async def __aiter__(self) -> AsyncIterator[pb.SessionEvent]:
        try:
            async for ev in self._call:
                yield ev
        except asyncio.CancelledError:
            err = None if self._cancelled else _closed_error(self._closed)
            if err is not None:
                raise err from None
            if not self._cancelled:
                raise
        except grpc.RpcError as e:
            if self._cancelled and e.code() == grpc.StatusCode.CANCELLED:
                return
            raise error_from_rpc(e) from None

    def cancel(self) -> None:
        """Stops watching."""
        self._cancelled = True
        self._call.cancel()

    async def __aenter__(self) -> "AsyncSubscription":
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cancel()


class _Pending:
    __slots__ = ("future", "events", "listener")

    def __init__(self, listener: Optional["asyncio.Queue[Any]"]) -> None:
        self.future: "asyncio.Future[UpdateResult]" = asyncio.get_running_loop().create_future()
        self.events: List[pb.ServerEvent] = []
        self.listener = listener


class AsyncSessionStream:
    """One ``Stream`` call under asyncio. Create it with ``await client.stream()``; use
    ``async with`` or :meth:`close`. Routing by ``seq`` is as in the blocking
    :class:`~compactd_client.SessionStream`.

    Updates are written by the stream's own writer task, in seq order, from a queue of at
    most ``MAX_UNSENT`` (past it, ``submit()`` waits for room): a caller cancelled while it
    waits (``asyncio.wait_for`` on a slow server) cancels only its own wait, where a
    cancelled write would make grpcio cancel the whole call.
    """

    def __init__(
        self,
        stub: pb.SessionsStub,
        metadata: Any = (),
        on_event: Optional[Callable[[pb.ServerEvent], None]] = None,
        max_update_bytes: Optional[int] = DEFAULT_MAX_UPDATE_BYTES,
    ) -> None:
        self._max_update_bytes = max_update_bytes
        self._call = stub.Stream(metadata=metadata)
        self._outbox: "deque[Any]" = deque()
        # Signalled when the outbox gains an item or room, and when the stream ends.
        self._changed = asyncio.Condition()
        self._seq = 0
        self._pending: Dict[int, _Pending] = {}
        self._listeners: Dict[int, "asyncio.Queue[Any]"] = {}
        # The session of each compaction started here (by its events' queue), for close().
        self._compacting: Dict["asyncio.Queue[Any]", str] = {}
        self._late: "asyncio.Queue[Any]" = asyncio.Queue(maxsize=LATE_EVENTS_KEPT)
        self._on_event = on_event
        self._failure: Optional[CompactdError] = None
        self._closing = False
        self._reader = asyncio.ensure_future(self._read())
        self._writer = asyncio.ensure_future(self._write())

    # Sending.

    async def submit(self, session_id: str, **update: Any) -> "asyncio.Future[UpdateResult]":
        """Queues one update for writing (waiting for room past ``MAX_UNSENT``); returns
        a future resolved on its ack or error. Cancelled while it waits, the update is
        not sent."""
        return await self._submit(session_id, update, None)

    async def send(self, session_id: str, **update: Any) -> UpdateResult:
        """Writes one update and awaits its ack; raises CompactdError on its error."""
        return await (await self.submit(session_id, **update))

    async def _submit(
        self, session_id: str, update: Dict[str, Any], listener: Optional["asyncio.Queue[Any]"]
    ) -> "asyncio.Future[UpdateResult]":
        if len(update) != 1:
            raise TypeError("an update sets exactly one ClientUpdate field")
        msg = pb.ClientUpdate(session_id=session_id, **update)
        unsequenced = msg.ByteSize() if self._max_update_bytes is not None else 0
        async with self._changed:
            # Waiting releases the lock; cancelled there, nothing is queued or numbered.
            while True:
                if self._closing:
                    raise RuntimeError("the stream is closed")
                if self._failure is not None:
                    raise after_stream_end(self._failure) from None
                if len(self._outbox) < MAX_UNSENT:
                    break
                await self._changed.wait()
            seq = self._seq + 1
            check_update_size(msg, update_size(unsequenced, seq), self._max_update_bytes)
            self._seq = msg.seq = seq  # queued in seq order, written in queue order
            pending = _Pending(listener)
            self._pending[seq] = pending
            self._outbox.append(msg)
            self._changed.notify_all()
        return pending.future

    @property
    def unsent(self) -> int:
        """Updates queued and not yet written to the stream (at most ``MAX_UNSENT``)."""
        return sum(1 for m in self._outbox if m is not _CLOSE)

    async def _write(self) -> None:
        """The writer task: writes the queued updates, then half-closes after
        :meth:`close`; ends when the stream does (the reader reports why)."""
        try:
            while True:
                async with self._changed:
                    while not self._outbox:
                        if self._failure is not None:
                            return
                        await self._changed.wait()
                    item = self._outbox.popleft()
                    self._changed.notify_all()  # room for a waiting submit()
                if item is _CLOSE:
                    await self._call.done_writing()
                    return
                await self._call.write(item)
        except (grpc.RpcError, asyncio.InvalidStateError):
            pass  # the call has ended: its reader fails the updates left unanswered
        except Exception:  # a bug here must not leave every update unsent and waiting
            _log.exception("compactd stream writer failed")
            self._call.cancel()

    # Receiving.

    async def _read(self) -> None:
        failure: Optional[CompactdError] = None
        try:
            async for ev in self._call:
                self._dispatch(ev)
        except grpc.RpcError as e:
            if not (self._closing and e.code() == grpc.StatusCode.CANCELLED):
                failure = error_from_rpc(e)
        except asyncio.CancelledError:
            pass
        except Exception as e:  # a bug here must not leave every ack waiting
            _log.exception("compactd stream reader failed")
            failure = CompactdError(grpc.StatusCode.INTERNAL, f"the stream's reader failed: {e!r}")
            self._call.cancel()
        if failure is None:
            failure = CompactdError(grpc.StatusCode.CANCELLED, "the stream ended")
        self._failure = failure
        self._outbox.clear()  # never written: their updates fail below, with the rest
        pending, self._pending = self._pending, {}
        listeners, self._listeners = self._listeners, {}
        for seq, p in pending.items():
            err = stream_ended(failure, seq)
            if not p.future.done():
                p.future.set_exception(err)
            if p.listener is not None:
                p.listener.put_nowait(err)
        for q in listeners.values():
            q.put_nowait(failure)
        _keep(self._late, _END)
        async with self._changed:
            self._changed.notify_all()  # a waiting submit() raises, the writer ends

    def _follows(self, listener: "asyncio.Queue[Any]") -> bool:
        """True while the compaction whose events go to ``listener`` has not ended (its
        ack, or its outcome, still to come)."""
        return any(q is listener for q in self._listeners.values()) or any(
            p.listener is listener for p in self._pending.values()
        )

    def _dispatch(self, ev: pb.ServerEvent) -> None:
        kind = ev.WhichOneof("event")
        p = self._pending.get(ev.seq)
        if p is not None:
            if kind == "ack":
                del self._pending[ev.seq]
                if p.listener is not None:
                    self._listeners[ev.seq] = p.listener
                if not p.future.done():
                    p.future.set_result(UpdateResult(ev.seq, ev.ack.kind, ev.ack.created, p.events))
            elif kind == "error":
                del self._pending[ev.seq]
                err = error_from_event(ev.error, ev.seq)
                if not p.future.done():
                    p.future.set_exception(err)
                if p.listener is not None:
                    p.listener.put_nowait(err)
            elif kind == "compaction" and p.listener is not None:
                p.listener.put_nowait(ev.compaction)  # `started` may precede the ack
            else:
                p.events.append(ev)
            return
        listener = self._listeners.get(ev.seq)
        if listener is not None and kind == "compaction":
            if ev.compaction.WhichOneof("event") in ("compacted", "failed"):
                del self._listeners[ev.seq]
            listener.put_nowait(ev.compaction)
        elif self._on_event is not None:
            try:
                self._on_event(ev)
            except Exception:  # the host's callback: its bug must not end the stream
                _log.exception("compactd stream on_event raised; the stream goes on")
        else:
            _keep(self._late, ev)

    async def next_event(self, timeout: Optional[float] = None) -> Optional[pb.ServerEvent]:
        """The next event that arrived after its update's ack and that no compaction of
        this stream claimed; None on timeout or once the stream has ended."""
        try:
            ev = await asyncio.wait_for(self._late.get(), timeout)
        except asyncio.TimeoutError:
            return None
        if ev is _END:
            _keep(self._late, _END)
            return None
        return ev

    # Closing.

    async def close(self, timeout: float = 10.0) -> None:
        """Half-closes the stream once the queued updates are written, and waits for the
        server to end it: ``timeout`` seconds in all (a server that does not read them
        included), then the call is cancelled and the updates left unanswered fail."""
        if self._closing:
            return
        self._closing = True  # from here, submit() refuses and a waiting one raises
        async with self._changed:  # held by no one across a wait: taken at once
            # compactd keeps a stream open until the compactions it started end: each is
            # cancelled first (else close() waited its whole timeout, and the compaction
            # went on to commit).
            for sid in dict.fromkeys(s for q, s in self._compacting.items() if self._follows(q)):
                self._seq += 1
                pending = _Pending(None)
                # Its answer is nobody's: retrieved, so asyncio logs no unread exception.
                pending.future.add_done_callback(lambda f: f.cancelled() or f.exception())
                self._pending[self._seq] = pending
                self._outbox.append(
                    pb.ClientUpdate(seq=self._seq, session_id=sid, cancel_compaction=pb.CancelCompaction())
                )
            self._outbox.append(_CLOSE)
            self._changed.notify_all()
        try:
            await asyncio.wait_for(asyncio.shield(self._reader), timeout)
        except asyncio.TimeoutError:
            self._call.cancel()
            await self._reader
        if not self._writer.done():  # a write the cancelled call left waiting
            self._writer.cancel()
        await asyncio.gather(self._writer, return_exceptions=True)

    async def __aenter__(self) -> "AsyncSessionStream":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # Typed updates.

    async def open(
        self,
        session_id: str,
        *,
        title: str = "",
        model: ModelLike = None,
        limits: LimitsLike = None,
        config: builders.Config = None,
        todos=(),
    ) -> UpdateResult:
        """Opens or reconfigures a session."""
        info = open_info(session_id, title, model, limits, config, todos)
        return await self.send(session_id, open=info)

    async def upsert_message(self, session_id: str, message: pb.MessageInfo) -> UpdateResult:
        """Inserts a message or updates it in place."""
        return await self.send(session_id, upsert_message=message)

    async def upsert_part(self, session_id: str, part: pb.Part) -> UpdateResult:
        """Inserts a part or updates it in place; its message must exist."""
        return await self.send(session_id, upsert_part=part)

    async def delete_part(self, session_id: str, message_id: str, part_id: str) -> UpdateResult:
        """Removes a part."""
        ref = pb.PartRef(message_id=message_id, part_id=part_id)
        return await self.send(session_id, delete_part=ref)

    async def report_usage(
        self, session_id: str, tokens: pb.TokenUsage, message_id: str = ""
    ) -> UpdateResult:
        """Records provider usage; ``result.overflow`` is set when it crossed the threshold."""
        return await self.send(session_id, report_usage=pb.UsageReport(message_id=message_id, tokens=tokens))

    async def pin(
        self, session_id: str, message_id: str, part_id: str = "", *, pinned: bool = True
    ) -> UpdateResult:
        """Pins (or unpins) a part or a whole message."""
        return await self.send(session_id, pin=pb.PinUpdate(**pin_fields(message_id, part_id, pinned)))

    async def get_context(
        self, session_id: str, format: "pb.ContextFormat" = pb.CONTEXT_FORMAT_UNSPECIFIED
    ) -> pb.Context:
        """The ready-to-send context, in order with the updates sent before it."""
        res = await self.send(session_id, get_context=pb.ContextOptions(format=format))
        assert res.context is not None, "get_context acked without a context event"
        return res.context

    async def openai_messages(self, session_id: str) -> List[Dict[str, Any]]:
        """The context as OpenAI chat ``messages``."""
        return openai_messages(await self.get_context(session_id, pb.CONTEXT_FORMAT_OPENAI_JSON))

    async def prune(self, session_id: str, *, dry_run: bool = False) -> pb.PruneReport:
        """Runs prune and the strategies now; their report."""
        res = await self.send(session_id, prune=pb.PruneOptions(dry_run=dry_run))
        assert res.prune_report is not None, "prune acked without a prune_report event"
        return res.prune_report

    async def check_overflow(self, session_id: str) -> pb.OverflowCheck:
        """The overflow decision now."""
        res = await self.send(session_id, check_overflow=pb.CheckOverflowOptions())
        assert res.overflow_check is not None, "check_overflow acked without its event"
        return res.overflow_check

    async def compact(
        self,
        session_id: str,
        *,
        instructions: str = "",
        prompt: str = "",
        system: str = "",
        template: str = "",
        model: str = "",
        tail_turns: Optional[int] = None,
    ) -> AsyncCompaction:
        """Starts a compaction on this stream; awaits its ack (a refusal raises) and
        returns its events. ``await cancel()`` sends a ``cancel_compaction`` update."""
        events: "asyncio.Queue[Any]" = asyncio.Queue()
        opts = compact_options(instructions, prompt, system, template, model, tail_turns)
        self._compacting = {q: sid for q, sid in self._compacting.items() if self._follows(q)}
        self._compacting[events] = session_id
        await (await self._submit(session_id, {"compact": opts}, events))

        async def source() -> AsyncIterator[pb.CompactionEvent]:
            while True:
                item = await events.get()
                if isinstance(item, BaseException):
                    raise item
                yield item

        async def cancel() -> None:
            if not self._follows(events):
                return  # over: a cancel now would stop the session's next compaction
            try:
                await self.send(session_id, cancel_compaction=pb.CancelCompaction())
            except CompactdError as e:
                if e.code != grpc.StatusCode.NOT_FOUND:
                    raise

        return AsyncCompaction(source(), cancel)


class AsyncClient:
    """An asyncio compactd client over one ``grpc.aio`` channel; arguments as
    :class:`~compactd_client.Client`. Create it inside a running event loop."""

    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        *,
        token: Optional[str] = None,
        credentials: Optional[grpc.ChannelCredentials] = None,
        timeout: Optional[float] = DEFAULT_TIMEOUT,
        channel: Optional[grpc.aio.Channel] = None,
        options: Optional[Sequence[Tuple[str, Any]]] = None,
        max_update_bytes: Optional[int] = DEFAULT_MAX_UPDATE_BYTES,
    ) -> None:
        # Checked first: a refused token opens no channel.
        self._md = auth_metadata(token)
        opts = with_channel_defaults(options)
        if channel is not None:
            self._channel, self._own = channel, False
        elif credentials is not None:
            self._channel, self._own = grpc.aio.secure_channel(target, credentials, opts), True
        else:
            self._channel, self._own = grpc.aio.insecure_channel(target, opts), True
        self.stub = pb.SessionsStub(self._channel)
        self._timeout = timeout
        self._max_update_bytes = max_update_bytes
        # Set by close(), shared with with_timeout()'s copies: calls grpc.aio cancels as
        # the channel closes raise CompactdError CANCELLED, not asyncio.CancelledError.
        self._closed: List[bool] = []

    def with_timeout(self, timeout: Optional[float]) -> "AsyncClient":
        """This client with another deadline for its unary calls (seconds; None: none),
        sharing the channel: ``c.with_timeout(300).import_session(doc)``. Closing the
        copy leaves the channel open."""
        other = copy.copy(self)
        other._own = False
        other._timeout = timeout
        return other

    async def _unary(self, method: Callable, request):
        try:
            return await method(request, metadata=self._md, timeout=self._timeout)
        except asyncio.CancelledError:
            err = _closed_error(self._closed)
            if err is None:
                raise
            raise err from None
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None

    async def close(self) -> None:
        """Closes the channel (when this client opened it). Calls still open on it end
        with CompactdError CANCELLED."""
        if self._own:
            self._closed.append(True)
            await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def wait_ready(self, timeout: float = 10.0) -> None:
        """Waits until the channel is connected, or raises CompactdError (UNAVAILABLE)."""
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout)
        except asyncio.TimeoutError:
            raise CompactdError(
                grpc.StatusCode.UNAVAILABLE, f"compactd not reachable within {timeout}s"
            ) from None

    async def stream(
        self, on_event: Optional[Callable[[pb.ServerEvent], None]] = None
    ) -> AsyncSessionStream:
        """Opens the bidirectional ``Stream`` (see :class:`AsyncSessionStream`)."""
        return AsyncSessionStream(
            self.stub, self._md, on_event=on_event, max_update_bytes=self._max_update_bytes
        )

    async def open_session(
        self,
        session_id: str,
        *,
        title: str = "",
        model: ModelLike = None,
        limits: LimitsLike = None,
        config: builders.Config = None,
        todos: Sequence[pb.Todo] = (),
    ) -> pb.SessionSummary:
        """Opens a session, or reconfigures it."""
        info = open_info(session_id, title, model, limits, config, todos)
        return await self._unary(self.stub.OpenSession, pb.OpenSessionRequest(session=info))

    async def get_session(self, session_id: str) -> pb.GetSessionResponse:
        """The whole session: info, every message and part."""
        return await self._unary(self.stub.GetSession, pb.GetSessionRequest(session_id=session_id))

    async def list_sessions(self, *, page_size: int = 1000) -> List[pb.SessionSummary]:
        """One summary per session held, in id order (cold sessions give their id and
        ``cold``), fetched ``page_size`` at a time so no reply outgrows the receive limit
        (the call timeout applies to each page)."""
        sessions: List[pb.SessionSummary] = []
        token: Optional[str] = ""
        while token is not None:
            reply = await self._unary(self.stub.ListSessions, list_sessions_request(page_size, token))
            sessions.extend(reply.sessions)
            token = next_page_token(token, reply)
        return sessions

    async def delete_session(self, session_id: str) -> bool:
        """Forgets a session; True when it existed."""
        req = pb.DeleteSessionRequest(session_id=session_id)
        return (await self._unary(self.stub.DeleteSession, req)).deleted

    async def import_session(
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
                return await self._unary(
                    self.stub.ImportSessionChunked, import_chunks(text, head, chunk_bytes)
                )
            except CompactdError as e:
                if e.code != grpc.StatusCode.UNIMPLEMENTED:
                    raise
        req = import_request(export, session_id, limits, config, replace, keep_compactions)
        return await self._unary(self.stub.ImportSession, req)

    async def upsert_message(self, session_id: str, message: pb.MessageInfo) -> UpdateResult:
        """Inserts a message or updates it in place."""
        req = pb.UpsertMessageRequest(session_id=session_id, message=message)
        return UpdateResult.from_events((await self._unary(self.stub.UpsertMessage, req)).events)

    async def upsert_part(self, session_id: str, part: pb.Part) -> UpdateResult:
        """Inserts a part or updates it in place; its message must exist."""
        req = pb.UpsertPartRequest(session_id=session_id, part=part)
        return UpdateResult.from_events((await self._unary(self.stub.UpsertPart, req)).events)

    async def delete_part(self, session_id: str, message_id: str, part_id: str) -> UpdateResult:
        """Removes a part."""
        req = pb.DeletePartRequest(session_id=session_id, message_id=message_id, part_id=part_id)
        return UpdateResult.from_events((await self._unary(self.stub.DeletePart, req)).events)

    async def report_usage(
        self, session_id: str, tokens: pb.TokenUsage, message_id: str = ""
    ) -> UpdateResult:
        """Records provider usage and checks overflow."""
        usage = pb.UsageReport(message_id=message_id, tokens=tokens)
        req = pb.ReportUsageRequest(session_id=session_id, usage=usage)
        return UpdateResult.from_events((await self._unary(self.stub.ReportUsage, req)).events)

    async def pin(
        self, session_id: str, message_id: str, part_id: str = "", *, pinned: bool = True
    ) -> UpdateResult:
        """Pins (or unpins) a part or a whole message."""
        req = pb.PinRequest(session_id=session_id, **pin_fields(message_id, part_id, pinned))
        return UpdateResult.from_events((await self._unary(self.stub.Pin, req)).events)

    async def get_context(
        self, session_id: str, format: "pb.ContextFormat" = pb.CONTEXT_FORMAT_UNSPECIFIED
    ) -> pb.Context:
        """The ready-to-send context."""
        req = pb.GetContextRequest(session_id=session_id, format=format)
        return await self._unary(self.stub.GetContext, req)

    async def openai_messages(self, session_id: str) -> List[Dict[str, Any]]:
        """The context as OpenAI chat ``messages`` (list of dicts)."""
        return openai_messages(await self.get_context(session_id, pb.CONTEXT_FORMAT_OPENAI_JSON))

    async def prune(self, session_id: str, *, dry_run: bool = False) -> pb.PruneReport:
        """Runs prune and the strategies now (or reports what they would do)."""
        req = pb.PruneRequest(session_id=session_id, dry_run=dry_run)
        return await self._unary(self.stub.Prune, req)

    async def check_overflow(self, session_id: str) -> pb.OverflowCheck:
        """The overflow decision with every number behind it."""
        req = pb.CheckOverflowRequest(session_id=session_id)
        return await self._unary(self.stub.CheckOverflow, req)

    async def recall(
        self, session_id: str, *, call_id: Optional[str] = None, part_id: Optional[str] = None
    ) -> pb.Recalled:
        """A part's original content by tool ``call_id`` or ``part_id``."""
        return await self._unary(self.stub.Recall, recall_request(session_id, call_id, part_id))

    async def recall_tool(self) -> Dict[str, Any]:
        """The ``compactd_recall`` tool definition as an OpenAI tool dict."""
        return recall_tool_dict(await self._unary(self.stub.GetRecallTool, pb.GetRecallToolRequest()))

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
    ) -> AsyncCompaction:
        """Starts a manual compaction; ``async for`` its events (``deltas()``,
        ``await wait()``). A refusal raises CompactdError when iteration starts."""
        opts = compact_options(instructions, prompt, system, template, model, tail_turns)
        call = self.stub.Compact(pb.CompactRequest(session_id=session_id, options=opts), metadata=self._md)
        cancelled = []

        async def events() -> AsyncIterator[pb.CompactionEvent]:
            try:
                async for ev in call:
                    yield ev
            except asyncio.CancelledError:
                if not cancelled:
                    err = _closed_error(self._closed)
                    if err is None:
                        raise
                    raise err from None
                yield cancelled_here(session_id)
            except grpc.RpcError as e:
                if cancelled and e.code() == grpc.StatusCode.CANCELLED:
                    yield cancelled_here(session_id)
                    return
                raise error_from_rpc(e) from None

        async def cancel() -> None:
            cancelled.append(True)
            call.cancel()

        return AsyncCompaction(events(), cancel)

    async def subscribe(self, session_id: str = "") -> AsyncSubscription:
        """Watches one session (or all with ``""``); returns once the watcher is
        registered. An unknown session raises NotFound here."""
        call = self.stub.Subscribe(pb.SubscribeRequest(session_id=session_id), metadata=self._md)
        try:
            await call.initial_metadata()
            if call.done():
                code = await call.code()
                if code != grpc.StatusCode.OK:
                    field, message = split_field(await call.details())
                    raise make_error(code, message, field)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None
        return AsyncSubscription(call, self._closed)
