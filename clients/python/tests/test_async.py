"""The asyncio client: every RPC, the stream and its errors, against the real binary.

Each test runs its coroutine with asyncio.run (no pytest plugin needed)."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from compactd_client import (
    AlreadyExists,
    AsyncClient,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    builders as b,
    pb,
)

PLACEHOLDER = "[Old tool result content cleared]"
CONFIG = {"prune_protect": 500, "prune_minimum": 100, "cache_model": "none", "prune": False}


def run(coro):
    return asyncio.run(coro)


def test_every_unary_rpc(server, sid: str, example_export: str) -> None:
    async def main() -> None:
        async with AsyncClient(server.addr, timeout=10) as c:
            await c.wait_ready()
            opened = await c.open_session(sid, limits=(128000, 8000), config=CONFIG, title="async")
            assert opened.created and opened.title == "async"
            await c.upsert_message(sid, b.user_message("u1"))
            await c.upsert_part(sid, b.text_part("u1", "t1", "hello"))
            for n in range(1, 5):
                await c.upsert_message(sid, b.user_message(f"u{n + 1}"))
                await c.upsert_message(sid, b.assistant_message(f"a{n}", f"u{n + 1}"))
                await c.upsert_part(sid, b.tool_part(f"a{n}", f"p{n}", call_id=f"c{n}", tool="bash",
                                                     input={"command": f"make step{n}"}, output=f"log {n} " * 500))
                await c.upsert_message(sid, b.assistant_message(f"a{n}", f"u{n + 1}", finish="tool-calls"))
            usage = await c.report_usage(sid, b.tokens(120000, 10), message_id="a4")
            assert usage.overflow and usage.overflow.overflow
            assert (await c.check_overflow(sid)).used == 120010
            assert (await c.prune(sid, dry_run=True)).dry_run
            report = await c.prune(sid)
            assert report.committed and report.parts[0].call_id == "c1"
            msgs = await c.openai_messages(sid)
            assert msgs[0] == {"role": "user", "content": "hello"}
            assert PLACEHOLDER in [m.get("content") for m in msgs]
            ctx = await c.get_context(sid, pb.CONTEXT_FORMAT_NATIVE)
            assert ctx.session_messages == 9 and not ctx.HasField("openai_messages")
            recalled = await c.recall(sid, call_id="c1")
            assert recalled.reduction == "cleared" and recalled.call.output.startswith("log 1")
            assert (await c.pin(sid, "a1", "p1")).kind == "pin"
            assert (await c.recall(sid, part_id="p1")).pinned
            await c.delete_part(sid, "a4", "p4")
            assert "c4" not in json.dumps(await c.openai_messages(sid))
            tool = await c.recall_tool()
            assert tool["function"]["name"] == "compactd_recall"
            full = await c.get_session(sid)
            assert full.info.title == "async" and len(full.messages) == 9
            imported = await c.import_session(json.loads(example_export), session_id=sid + "-imp")
            assert imported.messages == 11
            with pytest.raises(AlreadyExists):
                await c.import_session(example_export, session_id=sid + "-imp")
            ids = {s.id for s in await c.list_sessions()}
            assert {sid, sid + "-imp"} <= ids
            assert await c.delete_session(sid + "-imp")
            with pytest.raises(NotFound) as e:
                await c.delete_session(sid + "-imp")
            assert e.value.field == "session_id"

    run(main())


def test_stream_seq_ack_errors_and_pipelining(server, sid: str) -> None:
    async def main() -> None:
        async with AsyncClient(server.addr) as c:
            async with await c.stream() as s:
                opened = await s.open(sid, limits=(16000, 4000), config=CONFIG)
                assert (opened.seq, opened.created) == (1, True)
                await s.upsert_message(sid, b.user_message("m1"))
                futures = [await s.submit(sid, upsert_part=b.text_part("m1", f"p{i}", str(i)))
                           for i in range(30)]
                results = await asyncio.gather(*futures)
                assert [r.seq for r in results] == list(range(3, 33))
                with pytest.raises(FailedPrecondition) as e:
                    await s.upsert_part(sid, b.text_part("nope", "x", "x"))
                assert (e.value.field, e.value.seq) == ("upsert_part.message_id", 33)
                with pytest.raises(InvalidArgument) as e:
                    await s.upsert_part(sid, b.tool_part("m1", "t", call_id="c", tool="t", status="bogus"))
                assert e.value.field == "upsert_part.tool.state.status"
                # Still open after the errors.
                await s.upsert_message(sid, b.assistant_message("m2", "m1"))
                usage = await s.report_usage(sid, b.tokens(12000, 0))
                assert usage.overflow is not None
                assert (await s.check_overflow(sid)).overflow
                assert (await s.prune(sid, dry_run=True)).dry_run
                await s.pin(sid, "m1")
                await s.delete_part(sid, "m1", "p0")
                ctx = await s.get_context(sid, pb.CONTEXT_FORMAT_NATIVE)
                assert [p.id for p in ctx.messages[0].parts] == [f"p{i}" for i in range(1, 30)]
                with pytest.raises(FailedPrecondition):
                    await s.compact(sid)  # no LLM configured
            with pytest.raises(RuntimeError):
                await s.open(sid)

    run(main())


def test_subscribe_and_refusals(server, sid: str) -> None:
    async def main() -> None:
        async with AsyncClient(server.addr) as c:
            await c.open_session(sid, limits=(16000, 4000))
            with pytest.raises(NotFound) as e:
                await c.subscribe("no-such-session")
            assert e.value.field == "session_id" and e.value.code == grpc.StatusCode.NOT_FOUND
            sub = await c.subscribe(sid)
            await c.report_usage(sid, b.tokens(15000, 0))
            async def first():
                async for ev in sub:
                    return ev
            ev = await asyncio.wait_for(first(), 5)
            sub.cancel()
            assert ev.session_id == sid and ev.overflow.used == 15000
            with pytest.raises(InvalidArgument) as e:
                await c.open_session("")
            assert e.value.field == "session.id"
            with pytest.raises(FailedPrecondition) as e:
                await c.compact(sid).wait()
            assert "--llm-base-url" in e.value.message

    run(main())


def _big_part(i: int):
    """A text part of 16 KiB: a few dozen fill gRPC's windows toward a stopped server (and
    each costs a debug compactd a quarter of what 64 KiB did to count its tokens)."""
    return b.text_part("m1", f"p{i}", f"{i:06d}" + "x" * (16 << 10))


def test_a_cancelled_send_leaves_the_stream_open() -> None:
    # A caller whose wait is cancelled (wait_for timing out while the server does not
    # read) cancelled the write itself, and grpcio then cancelled the whole call: every
    # update in flight failed CANCELLED and the stream was dead.
    import signal

    from compactd_client.stream import MAX_UNSENT
    from compactd_server import Server

    srv = Server()

    async def main() -> None:
        sid = "cancelled-send"
        async with AsyncClient(srv.addr, timeout=30) as c:
            async with await c.stream() as s:
                await s.open(sid)
                await s.upsert_message(sid, b.user_message("m1"))
                srv.proc.send_signal(signal.SIGSTOP)
                earlier = []
                # A submit waits only once MAX_UNSENT are unsent: 5 s is far longer than any
                # of those before it takes, on a loaded machine too.
                with pytest.raises(asyncio.TimeoutError):
                    for i in range(MAX_UNSENT + 300):
                        earlier.append(await asyncio.wait_for(s.submit(sid, upsert_part=_big_part(i)), 5))
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(s.send(sid, upsert_part=_big_part(10_000)), 1)
                assert s.unsent == MAX_UNSENT  # the rest were written, the server reads none
                srv.proc.send_signal(signal.SIGCONT)
                # A debug compactd reads its first burst of 64 KiB updates slowly: 15 s for
                # these ~520 on a loaded 2-core machine.
                acked = await asyncio.wait_for(asyncio.gather(*earlier), 120)
                assert [r.seq for r in acked] == list(range(3, len(earlier) + 3))
                assert s.unsent == 0
                after = await asyncio.wait_for(s.upsert_part(sid, b.text_part("m1", "after", "x")), 30)
                assert after.created
                ids = [p.id for p in (await s.get_context(sid, pb.CONTEXT_FORMAT_NATIVE)).messages[0].parts]
                assert ids[: len(earlier)] == [f"p{i}" for i in range(len(earlier))]
                assert ids[-1] == "after"

    try:
        run(main())
    finally:
        srv.proc.send_signal(signal.SIGCONT)
        srv.stop()


def test_close_is_bounded_while_a_write_waits() -> None:
    # close(timeout) waited for the write lock, held by a write the stopped server never
    # made room for, before its timeout began: it waited as long as the server slept.
    import signal
    import time

    from compactd_client import CompactdError
    from compactd_client.stream import MAX_UNSENT
    from compactd_server import Server

    srv = Server()

    async def main() -> None:
        sid = "bounded-close"
        async with AsyncClient(srv.addr, timeout=30) as c:
            s = await c.stream()
            await s.open(sid)
            await s.upsert_message(sid, b.user_message("m1"))
            srv.proc.send_signal(signal.SIGSTOP)
            futures = []

            async def host() -> None:
                for i in range(MAX_UNSENT + 300):
                    futures.append(await s.submit(sid, upsert_part=_big_part(i)))

            task = asyncio.ensure_future(host())
            # Until the outbox is full (a host starved for a moment is not one that waits),
            # then until the writes stop moving: the server reads nothing more.
            deadline = time.monotonic() + 20
            while s.unsent < MAX_UNSENT:
                assert time.monotonic() < deadline, f"the outbox never filled: {s.unsent} unsent"
                await asyncio.sleep(0.05)
            last, still = -1, 0
            while still < 10:
                await asyncio.sleep(0.1)
                still = still + 1 if len(futures) == last else 0
                last = len(futures)
            began = time.monotonic()
            try:
                await asyncio.wait_for(s.close(1.0), 8)
            except asyncio.TimeoutError:
                pass  # took says so
            finally:
                took = time.monotonic() - began
                srv.proc.send_signal(signal.SIGCONT)
            assert took < 4, took
            # The host's waiting submit and every update left unanswered fail, not hang.
            with pytest.raises(RuntimeError, match="closed"):
                await asyncio.wait_for(task, 5)
            for f in futures:
                with pytest.raises(CompactdError) as e:
                    await asyncio.wait_for(f, 5)
                assert e.value.stream_ended

    try:
        run(main())
    finally:
        srv.proc.send_signal(signal.SIGCONT)
        srv.stop()


def test_closing_the_client_ends_its_open_calls_with_cancelled() -> None:
    # grpc.aio cancels the calls open on a channel it closes: the tasks awaiting them,
    # never cancelled themselves, got asyncio.CancelledError (which gather, TaskGroup and
    # `except CompactdError` read as the task's own cancellation).
    import signal

    from compactd_client import CompactdError
    from compactd_server import Server

    srv = Server()

    async def main() -> None:
        sid = "closed-under-calls"
        c = AsyncClient(srv.addr, timeout=30)
        await c.open_session(sid)
        sub = await c.subscribe(sid)

        async def watch() -> None:
            async for _ in sub:
                pass

        watching = asyncio.ensure_future(watch())
        srv.proc.send_signal(signal.SIGSTOP)
        unanswered = asyncio.ensure_future(c.get_context(sid))
        await asyncio.sleep(0.5)
        await c.close()
        for task in (unanswered, watching):
            with pytest.raises(CompactdError) as e:
                await asyncio.wait_for(task, 10)
            assert e.value.code == grpc.StatusCode.CANCELLED, e.value
            assert not task.cancelled()

    try:
        run(main())
    finally:
        srv.proc.send_signal(signal.SIGCONT)
        srv.stop()
