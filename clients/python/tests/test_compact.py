"""Compaction through the client: compactd started with --llm-base-url pointing at the
scripted fake endpoint (fake_openai.py), summary deltas streamed back in order."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Callable, Iterator

import pytest

from compactd_client import AsyncClient, Client, Compaction, CompactionFailed, builders as b, pb
from compactd_server import Server
from fake_openai import FakeOpenAI, Reply

SECRET = "sk-test-python-client-SECRET"


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeOpenAI]:
    f = FakeOpenAI()
    yield f
    f.stop()


@pytest.fixture(scope="module")
def llm_server(fake: FakeOpenAI) -> Iterator[Server]:
    srv = Server(
        ["--llm-base-url", fake.base_url, "--llm-model", "fake-model",
         "--llm-context-tokens", "100000", "--llm-max-retries", "0"],
        env={"COMPACTD_LLM_API_KEY": SECRET},
    )
    yield srv
    srv.stop()
    assert SECRET not in srv.log_text()


def seed(c: Client, sid: str) -> None:
    c.open_session(sid, limits=(128000, 8000))
    for n in range(1, 4):
        c.upsert_message(sid, b.user_message(f"u{n}"))
        c.upsert_part(sid, b.text_part(f"u{n}", f"u{n}-t", f"user turn {n}"))
        c.upsert_message(sid, b.assistant_message(f"a{n}", f"u{n}"))
        c.upsert_part(sid, b.tool_part(f"a{n}", f"a{n}-p", call_id=f"call_{n}", tool="read",
                                       input={"path": f"src/mod{n}.py"}, output=f"def f{n}(): pass\n" * 200))
        c.upsert_part(sid, b.text_part(f"a{n}", f"a{n}-t", f"answer {n}"))
        c.upsert_message(sid, b.assistant_message(f"a{n}", f"u{n}", finish="stop"))


def test_compact_streams_deltas_and_commits(llm_server: Server, fake: FakeOpenAI, sid: str) -> None:
    fake.push(Reply.text("## Objective\n", "Fix mod1 ", "and mod2.", usage=(900, 12)))
    before = len(fake.requests)
    with Client(llm_server.addr) as c:
        seed(c, sid)
        compaction = c.compact(sid, instructions="focus on mod1")
        deltas = list(compaction.deltas())
        assert deltas == ["## Objective\n", "Fix mod1 ", "and mod2."]
        done = compaction.wait()
        assert compaction.started is not None and not compaction.started.auto
        assert compaction.summary == "".join(deltas)
        assert done.summary_message_id and done.tokens_after < done.tokens_before
        assert done.usage.input == 900 and done.usage.output == 12

        sent = fake.requests[before]
        assert sent.path == "/v1/chat/completions" and sent.body["model"] == "fake-model"
        assert sent.body["stream"] is True
        assert sent.headers.get("authorization") == f"Bearer {SECRET}"
        assert "focus on mod1" in sent.text() and "user turn 1" in sent.text()

        ctx = c.get_context(sid)
        assert ctx.boundary_message_id == done.user_message_id
        msgs = c.openai_messages(sid)
        assert msgs[0]["role"] == "user"
        assert "".join(deltas) in msgs[1]["content"]
        assert "def f1(): pass" not in str(msgs)  # the head is summarized


def test_compact_failure_and_subscribe(llm_server: Server, fake: FakeOpenAI, sid: str) -> None:
    fake.push(Reply.error(400))
    with Client(llm_server.addr) as c:
        seed(c, sid)
        seen: list = []
        sub = c.subscribe(sid)
        reader = threading.Thread(target=lambda: seen.extend(ev for ev in sub), daemon=True)
        reader.start()
        with pytest.raises(CompactionFailed) as e:
            c.compact(sid).wait()
        assert e.value.kind == "request" and "400" in e.value.reason
        assert SECRET not in e.value.reason
        # The session is exactly as it was.
        assert c.get_context(sid).boundary_message_id == ""
        deadline = time.monotonic() + 15
        while not any(ev.compaction.WhichOneof("event") == "failed" for ev in seen):
            if time.monotonic() > deadline:
                break  # the assertion below says what the watcher saw
            time.sleep(0.05)
        sub.cancel()
        kinds = [ev.compaction.WhichOneof("event") for ev in seen if ev.WhichOneof("event") == "compaction"]
        assert kinds[0] == "started" and kinds[-1] == "failed"


def test_compact_on_the_stream_and_cancel(llm_server: Server, fake: FakeOpenAI, sid: str) -> None:
    # The first reply takes 10 s (two chunks 5 s apart): the cancel lands long before it
    # could commit, however slowly a loaded machine runs compactd.
    fake.push(Reply.text("slow ", "summary", delay=5), Reply.text("Summary ", "two."))

    def posts() -> int:
        return len([r for r in fake.requests if r.path.endswith("/chat/completions")])

    with Client(llm_server.addr) as c:
        seed(c, sid)
        with c.stream() as s:
            before = posts()
            running = s.compact(sid)
            first = next(iter(running))
            assert first.WhichOneof("event") == "started"
            # Cancel once the slow reply is being streamed: `started` comes before the
            # request (and compactd's window discovery) reaches the endpoint, and a cancel
            # before it would leave the slow reply to the next compaction.
            deadline = time.monotonic() + 10
            while posts() == before:
                assert time.monotonic() < deadline, "the summary request never reached the endpoint"
                time.sleep(0.02)
            running.cancel()
            with pytest.raises(CompactionFailed) as e:
                running.wait()
            assert e.value.kind == "cancelled"
            again = s.compact(sid, tail_turns=1)
            assert "".join(again.deltas()) == "Summary two."
            assert again.wait().summary_message_id
            assert s.get_context(sid).boundary_message_id == again.compacted.user_message_id


def test_async_compact(llm_server: Server, fake: FakeOpenAI, sid: str) -> None:
    fake.push(Reply.text("Async ", "summary."), Reply.text("Stream ", "summary."))
    with Client(llm_server.addr) as c:
        seed(c, sid)

    async def main() -> None:
        async with AsyncClient(llm_server.addr) as c:
            compaction = c.compact(sid)
            texts = [t async for t in compaction.deltas()]
            assert texts == ["Async ", "summary."]
            done = await compaction.wait()
            assert (await c.get_context(sid)).boundary_message_id == done.user_message_id
            await c.upsert_message(sid, b.user_message("u9"))
            await c.upsert_part(sid, b.text_part("u9", "u9-t", "more work"))
            async with await c.stream() as s:
                on_stream = await s.compact(sid)
                assert "".join([t async for t in on_stream.deltas()]) == "Stream summary."
                assert (await on_stream.wait()).summary_message_id

    asyncio.run(main())


def turn_updates(first: int, last: int) -> Iterator[tuple]:
    """User turns of ~2,000 tokens of prose each (prune cannot make room: only a
    compaction can), each answered briefly: (stream method, message or part) pairs."""
    for n in range(first, last + 1):
        yield "upsert_message", b.user_message(f"u{n}")
        yield "upsert_part", b.text_part(f"u{n}", f"u{n}-t", f"turn {n}: " + "lorem ipsum " * 700)
        yield "upsert_message", b.assistant_message(f"a{n}", f"u{n}")
        yield "upsert_part", b.text_part(f"a{n}", f"a{n}-t", f"answer {n}")
        yield "upsert_message", b.assistant_message(f"a{n}", f"u{n}", finish="stop")


def turns_on(s, sid: str, first: int, last: int) -> None:
    """:func:`turn_updates` sent on the blocking stream ``s``."""
    for method, value in turn_updates(first, last):
        getattr(s, method)(sid, value)


def test_a_raising_on_event_or_a_cancelled_future_does_not_end_the_stream(
    llm_server: Server, fake: FakeOpenAI, sid: str
) -> None:
    # An automatic compaction's events arrive after the ack of the update that started
    # it: they go to on_event, which raises (a host bug).
    fake.push(Reply.text("summary of the first turns", usage=(None, 12)))
    seen: list = []

    def boom(ev: pb.ServerEvent) -> None:
        seen.append(ev)
        raise ValueError("a bug in the host's callback")

    with Client(llm_server.addr) as c:
        with c.stream(on_event=boom) as s:
            s.open(sid, limits=(8000, 1000))
            turns_on(s, sid, 1, 5)
            deadline = time.monotonic() + 15
            while not any(ev.compaction.WhichOneof("event") == "compacted" for ev in seen):
                assert time.monotonic() < deadline, f"no automatic compaction: {seen}"
                time.sleep(0.05)
            # The stream still reads acks.
            check = s.submit(sid, check_overflow=pb.CheckOverflowOptions()).result(5)
            assert check.overflow_check is not None

            # A future the host gave up on (cancelled before its ack) leaves the stream
            # working too.
            given_up = s.submit(sid, check_overflow=pb.CheckOverflowOptions())
            given_up.cancel()
            assert s.submit(sid, check_overflow=pb.CheckOverflowOptions()).result(5).overflow_check

            # Waiting from on_event would wait for itself: refused, not a deadlock.
            errors: list = []

            def waits(ev: pb.ServerEvent) -> None:
                try:
                    s.check_overflow(sid)
                except RuntimeError as e:
                    errors.append(e)
                try:
                    s.next_event()  # no timeout: would wait for the thread it holds
                except RuntimeError as e:
                    errors.append(e)

            s._on_event = waits
            fake.push(Reply.text("summary of more turns", usage=(None, 12)))
            turns_on(s, sid, 6, 10)
            deadline = time.monotonic() + 15
            while len(errors) < 2:
                assert time.monotonic() < deadline, f"on_event never ran (or hung): {errors}"
                time.sleep(0.05)
            assert len(errors) >= 2 and all("on_event" in str(e) for e in errors), errors
            assert s.submit(sid, check_overflow=pb.CheckOverflowOptions()).result(5).overflow_check


def test_a_raising_on_event_does_not_end_the_async_stream(
    llm_server: Server, fake: FakeOpenAI, sid: str
) -> None:
    fake.push(Reply.text("summary of the first turns", usage=(None, 12)))
    seen: list = []

    def boom(ev: pb.ServerEvent) -> None:
        seen.append(ev)
        raise ValueError("a bug in the host's callback")

    async def main() -> None:
        async with AsyncClient(llm_server.addr) as c:
            async with await c.stream(on_event=boom) as s:
                await s.open(sid, limits=(8000, 1000))
                for method, value in turn_updates(1, 5):
                    await getattr(s, method)(sid, value)
                deadline = time.monotonic() + 15
                while not any(ev.compaction.WhichOneof("event") == "compacted" for ev in seen):
                    assert time.monotonic() < deadline, f"no automatic compaction: {seen}"
                    await asyncio.sleep(0.05)
                # The stream still reads acks.
                check = await asyncio.wait_for(s.check_overflow(sid), 5)
                assert check.threshold > 0

    asyncio.run(main())


def test_a_retry_voids_the_deltas_streamed_before_it() -> None:
    # compactd drops an answer it streamed when the endpoint had truncated the prompt,
    # says so with `retrying`, and streams the next answer from index 0.
    from compactd_client.compaction import _State

    state = _State()
    for ev in [
        pb.CompactionEvent(delta=pb.SummaryDelta(text="summary of what was kept", index=0)),
        pb.CompactionEvent(retrying=pb.CompactionRetrying(attempt=2, reason="truncated")),
        pb.CompactionEvent(delta=pb.SummaryDelta(text="the real ", index=0)),
        pb.CompactionEvent(delta=pb.SummaryDelta(text="summary", index=1)),
    ]:
        state._record(ev)
    assert state.summary == "the real summary"


def _posts(fake: FakeOpenAI) -> int:
    return len([r for r in fake.requests if r.path.endswith("/chat/completions")])


def _until_posted(fake: FakeOpenAI, before: int) -> None:
    deadline = time.monotonic() + 10
    while _posts(fake) == before:
        assert time.monotonic() < deadline, "the summary request never reached the endpoint"
        time.sleep(0.02)


def _asked(fake: FakeOpenAI, start: Callable[[], Compaction]) -> Compaction:
    """The compaction ``start`` begins, once its summary request reached the endpoint."""
    before = _posts(fake)
    running = start()
    assert next(iter(running)).WhichOneof("event") == "started"
    _until_posted(fake, before)
    return running


def _ends_cancelled(c: Client, sid: str, running: Compaction) -> None:
    """``running`` ends failed/cancelled, and the session holds no summary."""
    with pytest.raises(CompactionFailed) as e:
        running.wait()
    assert e.value.kind == "cancelled"
    assert c.get_context(sid).boundary_message_id == ""


def test_a_cancelled_compact_call_fails_as_cancelled(llm_server: Server, fake: FakeOpenAI, sid: str) -> None:
    # As a compaction cancelled on a stream ends. Before, the call ended without an
    # outcome and wait() raised RuntimeError, which no `except CompactionFailed` caught.
    fake.push(Reply.text("slow ", "summary", delay=5))
    with Client(llm_server.addr) as c:
        seed(c, sid)
        running = _asked(fake, lambda: c.compact(sid))
        running.cancel()
        _ends_cancelled(c, sid, running)


def test_cancelling_an_ended_compaction_leaves_the_next_one_running(
    llm_server: Server, fake: FakeOpenAI, sid: str
) -> None:
    # cancel_compaction stops whatever compaction the session runs: a stream compaction
    # that already ended must not send it. Before, it stopped the next one.
    fake.push(Reply.text("First summary."), Reply.text("second ", "summary", delay=2))
    with Client(llm_server.addr) as c:
        seed(c, sid)
        with c.stream() as s:
            first = s.compact(sid)
            first.wait()
            second = _asked(fake, lambda: c.compact(sid, tail_turns=1))
            first.cancel()
            assert second.wait().summary_message_id


def test_closing_a_stream_cancels_its_running_compaction(llm_server: Server, fake: FakeOpenAI, sid: str) -> None:
    # compactd keeps a stream open until the compactions it started end. Before, close()
    # waited its whole timeout (the slow reply ended first) and the compaction committed,
    # though close() says it is cancelled.
    fake.push(Reply.text("slow ", "summary", delay=3))
    with Client(llm_server.addr) as c:
        seed(c, sid)
        with c.stream() as s:
            running = _asked(fake, lambda: s.compact(sid))
        _ends_cancelled(c, sid, running)


def test_closing_an_async_stream_cancels_its_running_compaction(
    llm_server: Server, fake: FakeOpenAI, sid: str
) -> None:
    fake.push(Reply.text("slow ", "summary", delay=3))
    with Client(llm_server.addr) as c:
        seed(c, sid)
    before = _posts(fake)

    async def main() -> None:
        async with AsyncClient(llm_server.addr) as c:
            async with await c.stream() as s:
                running = await s.compact(sid)
                async for ev in running:
                    assert ev.WhichOneof("event") == "started"
                    break
                deadline = time.monotonic() + 10
                while _posts(fake) == before:
                    assert time.monotonic() < deadline, "the summary request never reached the endpoint"
                    await asyncio.sleep(0.02)
            with pytest.raises(CompactionFailed) as e:
                await running.wait()
            assert e.value.kind == "cancelled"
            assert (await c.get_context(sid)).boundary_message_id == ""

    asyncio.run(main())
