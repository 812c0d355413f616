"""The ``Stream`` RPC, blocking: updates go out with client-assigned seqs, each waits for
its ack (or error event), and the events it caused come back with it.

A background thread reads the server's events and routes each by ``seq``:

* before the update's ``ack``: kept with the update (``UpdateResult.events``);
* ``ack``: completes the update's future with an :class:`UpdateResult`;
* ``error``: fails it with the :class:`CompactdError` for the event's code and field
  (the stream stays open, the session unchanged);
* compaction events: to the compaction started by that update (before or after its
  ack), else to ``on_event`` or the queue read by :meth:`SessionStream.next_event`.

``on_event`` runs on that thread: an exception it raises is logged (logger
``compactd_client``) and the stream goes on; it may ``submit()`` updates but not wait for
them (their acks are read by the thread it holds), so the stream's waiting methods raise
``RuntimeError`` there. A future the host cancelled is left as it is when its ack comes.

Backpressure: at most ``MAX_UNSENT`` updates wait to be written (gRPC writes them as
the server reads); past that, ``submit()`` waits for room, as the asyncio stream's
``submit()`` does, so a host that outpaces a slow or stopped server holds a bounded
number of updates. On the reader thread (``on_event``) it never waits: that thread
must go on reading for room to come.

An update whose encoded size is over ``max_update_bytes`` raises ResourceExhausted and is
not sent (compactd would end the whole stream on one far past its limit). Once the stream
has ended, each update raises a new error with ``stream_ended`` set and no seq.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Dict, Iterator, List, Optional

import grpc

from . import builders, pb
from .compaction import Compaction
from .errors import (
    CompactdError,
    after_stream_end,
    error_from_event,
    error_from_rpc,
    make_error,
    stream_ended,
)
from .results import (
    LimitsLike,
    ModelLike,
    UpdateResult,
    compact_options,
    open_info,
    openai_messages,
    pin_fields,
)

__all__ = ["SessionStream"]

_CLOSE = object()
_END = object()

_log = logging.getLogger("compactd_client")

#: Events :meth:`SessionStream.next_event` keeps for a host that reads none (no
#: ``on_event``): past it the oldest are dropped, so a long stream's memory stays bounded.
LATE_EVENTS_KEPT = 1024

#: Updates submitted and not yet written, past which ``submit()`` waits (the server reads
#: at most 256 ahead of its acks; a few hundred more keep a burst flowing).
MAX_UNSENT = 512

#: compactd's default ``--max-update-bytes``: the largest update the stream sends. The
#: server ends the whole stream on one much past its limit; the client refuses it alone.
DEFAULT_MAX_UPDATE_BYTES = 16 * 1024 * 1024


def _keep(q: Any, item: Any, full: type = queue.Full, empty: type = queue.Empty) -> None:
    """Puts ``item`` on the bounded ``q``, dropping the oldest entry when it is full
    (a ``queue.Queue``, or an ``asyncio.Queue`` with its ``QueueFull``/``QueueEmpty``)."""
    while True:
        try:
            q.put_nowait(item)
            return
        except full:
            try:
                q.get_nowait()
            except empty:
                pass


def update_size(unsequenced: int, seq: int) -> int:
    """The encoded size of a ``ClientUpdate`` that is ``unsequenced`` bytes without its
    seq, once ``seq`` is set (field 1: one tag byte and the varint). Measured before the
    seq is known, outside the stream's lock: ``ByteSize()`` encodes the whole update."""
    return unsequenced + 1 + max(1, (seq.bit_length() + 6) // 7)


def check_update_size(msg: pb.ClientUpdate, size: int, limit: Optional[int]) -> None:
    """Raises ResourceExhausted for an update of ``size`` encoded bytes over ``limit``
    (``max_update_bytes``; None: no limit), before it is written: compactd would end the
    whole stream on it, so it alone is refused and the stream goes on."""
    if limit is None or size <= limit:
        return
    raise make_error(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"an update of {size} bytes ({msg.WhichOneof('update')}) is over max_update_bytes "
        f"({limit} bytes), so it was not sent and the stream goes on: send large content "
        "in smaller parts, or raise max_update_bytes with the server's --max-update-bytes",
    )


def _settle(future: "Future[Any]", result: Any = None, error: Optional[BaseException] = None) -> None:
    """Completes ``future`` unless the host cancelled it (or it is already done)."""
    if future.done():
        return
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:  # cancelled meanwhile
        pass


def _left(deadline: Optional[float]) -> Optional[float]:
    """Seconds until ``deadline`` (``time.monotonic()``), 0 once past; None for none."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class _Pending:
    __slots__ = ("future", "events", "listener")

    def __init__(self, listener: Optional["queue.Queue[Any]"]) -> None:
        self.future: "Future[UpdateResult]" = Future()
        self.events: List[pb.ServerEvent] = []
        self.listener = listener


class SessionStream:
    """One ``Stream`` call; use it as a context manager or call :meth:`close`.

    The stream serves any number of sessions (every update names its session). It is
    thread-safe: updates from several threads get increasing seqs in the order they
    were submitted, and the server applies and acks them in that order.
    """

    def __init__(
        self,
        stub: pb.SessionsStub,
        metadata: Any = (),
        on_event: Optional[Callable[[pb.ServerEvent], None]] = None,
        max_update_bytes: Optional[int] = DEFAULT_MAX_UPDATE_BYTES,
    ) -> None:
        self._max_update_bytes = max_update_bytes
        self._outbox: "deque[Any]" = deque()
        self._lock = threading.Lock()
        # Signalled when the outbox gains an item or room, and when the stream ends.
        self._changed = threading.Condition(self._lock)
        self._seq = 0
        self._pending: Dict[int, _Pending] = {}
        self._listeners: Dict[int, "queue.Queue[Any]"] = {}
        # The session of each compaction started here (by its events' queue), for close().
        self._compacting: Dict["queue.Queue[Any]", str] = {}
        self._late: "queue.Queue[Any]" = queue.Queue(maxsize=LATE_EVENTS_KEPT)
        self._on_event = on_event
        self._failure: Optional[CompactdError] = None
        self._closing = False
        self._call = stub.Stream(self._requests(), metadata=metadata)
        self._reader = threading.Thread(target=self._read, name="compactd-stream", daemon=True)
        self._reader.start()

    # Sending.

    def submit(self, session_id: str, **update: Any) -> "Future[UpdateResult]":
        """Sends one update without waiting; the future resolves on its ack or error.

        ``update`` is exactly one ``ClientUpdate`` oneof field, e.g.
        ``upsert_part=builders.text_part(...)``.
        """
        return self._submit(session_id, update, None)

    def send(self, session_id: str, timeout: Optional[float] = None, **update: Any) -> UpdateResult:
        """Sends one update and waits for its ack; raises CompactdError on its error.
        ``timeout`` bounds the whole wait, for room in a full send queue too
        (``concurrent.futures.TimeoutError``; past the queue, the update may still apply)."""
        self._not_on_reader("send")
        deadline = None if timeout is None else time.monotonic() + timeout
        return self._submit(session_id, update, None, deadline).result(_left(deadline))

    def _not_on_reader(self, what: str) -> None:
        # The reader thread would wait for an ack only it can read: a deadlock.
        if threading.current_thread() is self._reader:
            raise RuntimeError(
                f"SessionStream.{what}() called from on_event, on the stream's reader "
                "thread: it would wait for an ack only that thread reads; use submit() "
                "without waiting, or act from another thread"
            )

    def _submit(
        self,
        session_id: str,
        update: Dict[str, Any],
        listener: Optional["queue.Queue[Any]"],
        deadline: Optional[float] = None,
    ) -> "Future[UpdateResult]":
        if len(update) != 1:
            raise TypeError("an update sets exactly one ClientUpdate field")
        msg = pb.ClientUpdate(session_id=session_id, **update)
        unsequenced = msg.ByteSize() if self._max_update_bytes is not None else 0
        may_wait = threading.current_thread() is not self._reader
        with self._changed:
            # Waiting releases the lock: the reader goes on routing events meanwhile.
            while True:
                if self._closing:
                    raise RuntimeError("the stream is closed")
                if self._failure is not None:
                    raise after_stream_end(self._failure) from None
                if not may_wait or len(self._outbox) < MAX_UNSENT:
                    break
                left = _left(deadline)
                if left == 0:
                    raise FutureTimeout(
                        f"the stream's send queue stayed full ({MAX_UNSENT} updates unsent): "
                        "this update was not sent"
                    )
                self._changed.wait(left)
            seq = self._seq + 1
            check_update_size(msg, update_size(unsequenced, seq), self._max_update_bytes)
            self._seq = msg.seq = seq
            pending = _Pending(listener)
            self._pending[seq] = pending
            self._outbox.append(msg)
            self._changed.notify_all()
        return pending.future

    def _follows(self, listener: "queue.Queue[Any]") -> bool:
        """True while the compaction whose events go to ``listener`` has not ended (its
        ack, or its outcome, still to come)."""
        with self._lock:
            return self._follows_locked(listener)

    def _follows_locked(self, listener: "queue.Queue[Any]") -> bool:
        return any(q is listener for q in self._listeners.values()) or any(
            p.listener is listener for p in self._pending.values()
        )

    @property
    def unsent(self) -> int:
        """Updates submitted and not yet written to the stream (at most ``MAX_UNSENT``,
        but for those ``on_event`` submitted)."""
        with self._lock:
            return sum(1 for m in self._outbox if m is not _CLOSE)

    def _requests(self) -> Iterator[pb.ClientUpdate]:
        while True:
            with self._changed:
                while not self._outbox and self._failure is None:
                    self._changed.wait()
                if not self._outbox:
                    return  # the stream ended: nothing more is read
                item = self._outbox.popleft()
                self._changed.notify_all()  # room for a waiting submit()
            if item is _CLOSE:
                return
            yield item

    # Receiving.

    def _read(self) -> None:
        failure: Optional[CompactdError] = None
        try:
            for ev in self._call:
                self._dispatch(ev)
        except grpc.RpcError as e:
            if not (self._closing and e.code() == grpc.StatusCode.CANCELLED):
                failure = error_from_rpc(e)
        except BaseException as e:  # a bug here must not leave every ack waiting
            _log.exception("compactd stream reader failed")
            failure = CompactdError(grpc.StatusCode.INTERNAL, f"the stream's reader failed: {e!r}")
            self._call.cancel()
        if failure is None:
            failure = CompactdError(grpc.StatusCode.CANCELLED, "the stream ended")
        with self._changed:
            self._failure = failure
            pending, self._pending = self._pending, {}
            listeners, self._listeners = self._listeners, {}
            self._changed.notify_all()  # a waiting submit() raises, the writer ends
        for seq, p in pending.items():
            err = stream_ended(failure, seq)
            _settle(p.future, error=err)
            if p.listener is not None:
                p.listener.put(err)
        for q in listeners.values():
            q.put(failure)  # a compaction still running reads why it ended
        _keep(self._late, _END)  # wakes a next_event() waiter

    def _dispatch(self, ev: pb.ServerEvent) -> None:
        kind = ev.WhichOneof("event")
        with self._lock:
            p = self._pending.get(ev.seq)
            if p is not None and kind in ("ack", "error"):
                del self._pending[ev.seq]
                if p.listener is not None and kind == "ack":
                    self._listeners[ev.seq] = p.listener
            late_listener = self._listeners.get(ev.seq) if p is None else None
            if late_listener is not None and kind == "compaction":
                if ev.compaction.WhichOneof("event") in ("compacted", "failed"):
                    del self._listeners[ev.seq]
        if p is not None:
            if kind == "ack":
                _settle(p.future, UpdateResult(ev.seq, ev.ack.kind, ev.ack.created, p.events))
            elif kind == "error":
                err = error_from_event(ev.error, ev.seq)
                _settle(p.future, error=err)
                if p.listener is not None:
                    p.listener.put(err)
            elif kind == "compaction" and p.listener is not None:
                p.listener.put(ev.compaction)  # `started` may precede the ack
            else:
                p.events.append(ev)
        elif late_listener is not None and kind == "compaction":
            late_listener.put(ev.compaction)
        elif self._on_event is not None:
            try:
                self._on_event(ev)
            except Exception:  # the host's callback: its bug must not end the stream
                _log.exception("compactd stream on_event raised; the stream goes on")
        else:
            _keep(self._late, ev)

    def next_event(self, timeout: Optional[float] = None) -> Optional[pb.ServerEvent]:
        """The next event that arrived after its update's ack and no compaction of
        this stream claimed (an automatic compaction's events); None on timeout or once
        the stream has ended. The newest ``LATE_EVENTS_KEPT`` are kept."""
        self._not_on_reader("next_event")
        try:
            ev = self._late.get(timeout=timeout)
        except queue.Empty:
            return None
        if ev is _END:
            _keep(self._late, _END)
            return None
        return ev

    # Closing.

    def close(self, timeout: float = 10.0) -> None:
        """Half-closes the stream once every sent update is answered, then waits for the
        server to end it (a running compaction of this stream is cancelled)."""
        with self._changed:
            if self._closing:
                return
            # compactd keeps a stream open until the compactions it started end: each is
            # cancelled first. Before, close() waited its whole timeout, cancelled the
            # call, and the compaction went on to commit.
            for sid in dict.fromkeys(s for q, s in self._compacting.items() if self._follows_locked(q)):
                self._seq += 1
                self._pending[self._seq] = _Pending(None)
                self._outbox.append(
                    pb.ClientUpdate(seq=self._seq, session_id=sid, cancel_compaction=pb.CancelCompaction())
                )
            self._closing = True
            self._outbox.append(_CLOSE)
            self._changed.notify_all()
        if threading.current_thread() is self._reader:
            return  # from on_event: the reader ends the stream once the server does
        self._reader.join(timeout)
        if self._reader.is_alive():
            self._call.cancel()
            self._reader.join(timeout)

    def __enter__(self) -> "SessionStream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # Typed updates.

    def open(
        self,
        session_id: str,
        *,
        title: str = "",
        model: ModelLike = None,
        limits: LimitsLike = None,
        config: builders.Config = None,
        todos=(),
    ) -> UpdateResult:
        """Opens or reconfigures a session (``result.created`` tells a new one)."""
        return self.send(session_id, open=open_info(session_id, title, model, limits, config, todos))

    def upsert_message(self, session_id: str, message: pb.MessageInfo) -> UpdateResult:
        """Inserts a message or updates it in place."""
        return self.send(session_id, upsert_message=message)

    def upsert_part(self, session_id: str, part: pb.Part) -> UpdateResult:
        """Inserts a part or updates it in place; its message must exist."""
        return self.send(session_id, upsert_part=part)

    def delete_part(self, session_id: str, message_id: str, part_id: str) -> UpdateResult:
        """Removes a part."""
        return self.send(session_id, delete_part=pb.PartRef(message_id=message_id, part_id=part_id))

    def report_usage(self, session_id: str, tokens: pb.TokenUsage, message_id: str = "") -> UpdateResult:
        """Records provider usage; ``result.overflow`` is set when it crossed the threshold."""
        return self.send(session_id, report_usage=pb.UsageReport(message_id=message_id, tokens=tokens))

    def pin(self, session_id: str, message_id: str, part_id: str = "", *, pinned: bool = True) -> UpdateResult:
        """Pins (or unpins) a part or a whole message."""
        return self.send(session_id, pin=pb.PinUpdate(**pin_fields(message_id, part_id, pinned)))

    def get_context(
        self, session_id: str, format: "pb.ContextFormat" = pb.CONTEXT_FORMAT_UNSPECIFIED
    ) -> pb.Context:
        """The ready-to-send context, in order with the updates sent before it."""
        res = self.send(session_id, get_context=pb.ContextOptions(format=format))
        assert res.context is not None, "get_context acked without a context event"
        return res.context

    def openai_messages(self, session_id: str) -> List[Dict[str, Any]]:
        """The context as OpenAI chat ``messages``."""
        return openai_messages(self.get_context(session_id, pb.CONTEXT_FORMAT_OPENAI_JSON))

    def prune(self, session_id: str, *, dry_run: bool = False) -> pb.PruneReport:
        """Runs prune and the strategies now; their report."""
        res = self.send(session_id, prune=pb.PruneOptions(dry_run=dry_run))
        assert res.prune_report is not None, "prune acked without a prune_report event"
        return res.prune_report

    def check_overflow(self, session_id: str) -> pb.OverflowCheck:
        """The overflow decision now."""
        res = self.send(session_id, check_overflow=pb.CheckOverflowOptions())
        assert res.overflow_check is not None, "check_overflow acked without its event"
        return res.overflow_check

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
        timeout: Optional[float] = None,
    ) -> Compaction:
        """Starts a compaction on this stream; waits for its ack (a refusal raises) and
        returns its events. ``cancel()`` sends a ``cancel_compaction`` update."""
        self._not_on_reader("compact")
        events: "queue.Queue[Any]" = queue.Queue()
        opts = compact_options(instructions, prompt, system, template, model, tail_turns)
        with self._lock:
            self._compacting = {q: sid for q, sid in self._compacting.items() if self._follows_locked(q)}
            self._compacting[events] = session_id
        deadline = None if timeout is None else time.monotonic() + timeout
        self._submit(session_id, {"compact": opts}, events, deadline).result(_left(deadline))

        def source() -> Iterator[pb.CompactionEvent]:
            self._not_on_reader("compaction events")
            while True:
                item = events.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item

        def cancel() -> None:
            if not self._follows(events):
                return  # over: a cancel now would stop the session's next compaction
            try:
                self.send(session_id, cancel_compaction=pb.CancelCompaction())
            except CompactdError as e:
                if e.code != grpc.StatusCode.NOT_FOUND:  # already over
                    raise

        return Compaction(source(), cancel)
