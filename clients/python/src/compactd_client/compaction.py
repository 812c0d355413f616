"""A running compaction as an iterator (sync) or async iterator of its events.

``Client.compact`` / ``SessionStream.compact`` (and their asyncio twins) return one. Iterate
it for every ``pb.CompactionEvent`` (started, delta, retrying, then compacted or failed),
or ``deltas()`` for the summary text as it is written, or ``wait()`` for the final
``pb.SessionCompacted`` (raising :class:`~compactd_client.errors.CompactionFailed`).
"""

from __future__ import annotations

from typing import AsyncIterator, Awaitable, Callable, Iterator, List, Optional

from . import pb
from .errors import CompactionFailed

__all__ = ["Compaction", "AsyncCompaction", "cancelled_here"]


def cancelled_here(session_id: str) -> pb.CompactionEvent:
    """The outcome of a ``Compact`` call this client cancelled: ``failed`` with kind
    ``cancelled``, as a compaction cancelled on a stream ends (the call ends without one,
    and ``wait()`` raised ``RuntimeError`` instead of ``CompactionFailed``)."""
    return pb.CompactionEvent(
        session_id=session_id,
        failed=pb.CompactionFailed(
            kind="cancelled",
            reason="cancelled by this client; a commit that raced the cancel is not reported",
        ),
    )


class _State:
    """What the events of one compaction have told so far."""

    def __init__(self) -> None:
        self.events: List[pb.CompactionEvent] = []
        self.compaction_id: str = ""
        self.started: Optional[pb.CompactionStarted] = None
        self.compacted: Optional[pb.SessionCompacted] = None
        self.failed: Optional[pb.CompactionFailed] = None
        self._deltas: List[str] = []

    @property
    def summary(self) -> str:
        """The summary text streamed so far (the deltas concatenated)."""
        return "".join(self._deltas)

    @property
    def done(self) -> bool:
        """True once ``compacted`` or ``failed`` arrived."""
        return self.compacted is not None or self.failed is not None

    def _record(self, ev: pb.CompactionEvent) -> None:
        self.events.append(ev)
        self.compaction_id = self.compaction_id or ev.compaction_id
        kind = ev.WhichOneof("event")
        if kind == "started":
            self.started = ev.started
        elif kind == "retrying":
            # A retry voids what was streamed before it.
            self._deltas.clear()
        elif kind == "delta":
            self._deltas.append(ev.delta.text)
        elif kind == "compacted":
            self.compacted = ev.compacted
        elif kind == "failed":
            self.failed = ev.failed

    def _result(self) -> pb.SessionCompacted:
        if self.failed is not None:
            raise CompactionFailed(self.failed)
        if self.compacted is None:
            raise RuntimeError("the compaction's event stream ended without compacted or failed")
        return self.compacted


class Compaction(_State):
    """A compaction's events, consumed once, in order (blocking iterator)."""

    def __init__(self, events: Iterator[pb.CompactionEvent], cancel: Callable[[], None]) -> None:
        super().__init__()
        self._source = events
        self._cancel = cancel

    def __iter__(self) -> Iterator[pb.CompactionEvent]:
        if self.done:
            return
        for ev in self._source:
            self._record(ev)
            yield ev
            if self.done:
                return

    def deltas(self) -> Iterator[str]:
        """The summary text as it arrives, delta by delta. A ``retrying`` event voids
        what came before it (the answer was dropped and is asked again): the text
        committed is ``summary`` once ``wait()`` returned."""
        for ev in self:
            if ev.WhichOneof("event") == "delta":
                yield ev.delta.text

    def wait(self) -> pb.SessionCompacted:
        """Reads to the end; the ``session.compacted`` event, or CompactionFailed."""
        for _ in self:
            pass
        return self._result()

    def cancel(self) -> None:
        """Cancels the compaction (and its LLM request); it commits nothing."""
        self._cancel()


class AsyncCompaction(_State):
    """A compaction's events, consumed once, in order (async iterator)."""

    def __init__(
        self, events: AsyncIterator[pb.CompactionEvent], cancel: Callable[[], Awaitable[None]]
    ) -> None:
        super().__init__()
        self._source = events
        self._cancel = cancel

    async def __aiter__(self) -> AsyncIterator[pb.CompactionEvent]:
        if self.done:
            return
        async for ev in self._source:
            self._record(ev)
            yield ev
            if self.done:
                return

    async def deltas(self) -> AsyncIterator[str]:
        """The summary text as it arrives, delta by delta. A ``retrying`` event voids
        what came before it (the answer was dropped and is asked again): the text
        committed is ``summary`` once ``wait()`` returned."""
        async for ev in self:
            if ev.WhichOneof("event") == "delta":
                yield ev.delta.text

    async def wait(self) -> pb.SessionCompacted:
        """Reads to the end; the ``session.compacted`` event, or CompactionFailed."""
        async for _ in self:
            pass
        return self._result()

    async def cancel(self) -> None:
        """Cancels the compaction (and its LLM request); it commits nothing."""
        await self._cancel()
