"""Bad input: the gRPC code and the field compactd names, on unary calls and on the
stream (where the field sits under the update's oneof name and the stream stays open)."""

from __future__ import annotations

import asyncio
import traceback
from typing import Callable

import grpc
import pytest

from compactd_client import (
    AsyncClient,
    Client,
    CompactdError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    builders as b,
    pb,
)

CASES = [
    # (name, call, exception, code, field)
    ("open without id", lambda c, s: c.open_session(""), InvalidArgument, "INVALID_ARGUMENT", "session.id"),
    ("threshold out of range", lambda c, s: c.open_session(s, config={"threshold": 2.0}),
     InvalidArgument, "INVALID_ARGUMENT", "session.config.threshold"),
    ("missing session id", lambda c, s: c.upsert_message("", b.user_message("m")),
     InvalidArgument, "INVALID_ARGUMENT", "session_id"),
    ("unknown session", lambda c, s: c.get_context("no-such-session"), NotFound, "NOT_FOUND", "session_id"),
    ("message without id", lambda c, s: c.upsert_message(s, pb.MessageInfo(role="user")),
     InvalidArgument, "INVALID_ARGUMENT", "message.id"),
    ("unknown role", lambda c, s: c.upsert_message(s, pb.MessageInfo(id="m", role="robot")),
     InvalidArgument, "INVALID_ARGUMENT", "message.role"),
    ("role change", lambda c, s: c.upsert_message(s, b.assistant_message("u", "x")),
     FailedPrecondition, "FAILED_PRECONDITION", "message.role"),
    ("part for unknown message", lambda c, s: c.upsert_part(s, b.text_part("nope", "p", "x")),
     FailedPrecondition, "FAILED_PRECONDITION", "part.message_id"),
    ("part without kind", lambda c, s: c.upsert_part(s, pb.Part(id="p", message_id="u")),
     InvalidArgument, "INVALID_ARGUMENT", "part.kind"),
    ("unknown tool status", lambda c, s: c.upsert_part(s, b.tool_part("u", "p", call_id="c", tool="t", status="bogus")),
     InvalidArgument, "INVALID_ARGUMENT", "part.tool.state.status"),
    ("delete unknown part", lambda c, s: c.delete_part(s, "u", "nope"), NotFound, "NOT_FOUND", "part_id"),
    ("usage for unknown message", lambda c, s: c.report_usage(s, b.tokens(1, 1), message_id="nope"),
     NotFound, "NOT_FOUND", "usage.message_id"),
    ("pin unknown message", lambda c, s: c.pin(s, "nope"), NotFound, "NOT_FOUND", "message_id"),
    ("pin unknown part", lambda c, s: c.pin(s, "u", "nope"), NotFound, "NOT_FOUND", "part_id"),
    ("recall unknown call", lambda c, s: c.recall(s, call_id="nope"), NotFound, "NOT_FOUND", "call_id"),
    ("delete unknown session", lambda c, s: c.delete_session("no-such-session"), NotFound, "NOT_FOUND", "session_id"),
    ("import a bad role", lambda c, s: c.import_session(
        {"info": {"id": "q"}, "messages": [{"info": {"id": "a", "role": "robot"}, "parts": []}]}),
     InvalidArgument, "INVALID_ARGUMENT", "export.messages[0].info.role"),
    ("import text that is not JSON", lambda c, s: c.import_session("{not json"),
     InvalidArgument, "INVALID_ARGUMENT", "export_json.$"),
    ("compact without an LLM", lambda c, s: c.compact(s).wait(), FailedPrecondition, "FAILED_PRECONDITION", ""),
    ("subscribe to unknown session", lambda c, s: c.subscribe("no-such-session"), NotFound, "NOT_FOUND", "session_id"),
]


@pytest.mark.parametrize("name,call,exc,code,field", CASES, ids=[c[0] for c in CASES])
def test_unary_refusals(client: Client, sid: str, name: str, call: Callable, exc: type,
                        code: str, field: str) -> None:
    client.open_session(sid)
    client.upsert_message(sid, b.user_message("u"))
    before = client.get_session(sid)
    with pytest.raises(exc) as e:
        call(client, sid)
    assert e.value.code_name == code and e.value.code == getattr(grpc.StatusCode, code)
    assert e.value.field == field
    assert e.value.message and not e.value.message.startswith(field + ":")
    assert e.value.seq is None
    after = client.get_session(sid)
    assert after.messages == before.messages  # a rejected update changes nothing


def test_stream_error_events_name_the_oneof(client: Client, sid: str) -> None:
    with client.stream() as s:
        s.open(sid)
        s.upsert_message(sid, b.user_message("u"))
        cases = [
            (lambda: s.upsert_part(sid, b.text_part("nope", "p", "x")), FailedPrecondition, "upsert_part.message_id"),
            (lambda: s.upsert_message(sid, pb.MessageInfo(id="m", role="robot")), InvalidArgument, "upsert_message.role"),
            (lambda: s.get_context("no-such-session"), NotFound, "session_id"),
            (lambda: s.pin(sid, "nope"), NotFound, "pin.message_id"),
            (lambda: s.send(sid, cancel_compaction=pb.CancelCompaction()), NotFound, ""),
            (lambda: s.compact(sid), FailedPrecondition, ""),
        ]
        for call, exc, field in cases:
            with pytest.raises(exc) as e:
                call()
            assert e.value.field == field, e.value
            assert isinstance(e.value.seq, int) and e.value.seq > 0
        # The stream is still open and the session unchanged.
        assert s.upsert_part(sid, b.text_part("u", "p", "still here")).created
        assert s.openai_messages(sid) == [{"role": "user", "content": "still here"}]


def test_error_str_carries_code_and_field(client: Client) -> None:
    with pytest.raises(CompactdError) as e:
        client.get_context("no-such-session")
    assert str(e.value).startswith("NOT_FOUND [session_id]: session no-such-session")


def test_unreachable_server_is_unavailable() -> None:
    with Client("127.0.0.1:1", timeout=2) as c:
        with pytest.raises(CompactdError) as e:
            c.list_sessions()
    assert e.value.code == grpc.StatusCode.UNAVAILABLE


@pytest.fixture(scope="module")
def small_updates():
    """compactd refusing updates over 64 KiB (the transport cap ends the stream)."""
    from compactd_server import Server

    srv = Server(["--max-update-bytes", "65536"])
    yield srv
    srv.stop()


def test_updates_left_unanswered_when_the_stream_ends_say_their_outcome_is_unknown(small_updates) -> None:
    # An update past the transport cap ends the whole stream (RESOURCE_EXHAUSTED): the
    # updates sent after it were never read, and had a slow reader ended it, those read
    # would have been applied. Their errors said "RESOURCE_EXHAUSTED" as if each update
    # had been refused for its own size.
    sid = "stream-ended"
    with Client(small_updates.addr, timeout=10) as c, c.stream() as s:
        s.open(sid)
        s.upsert_message(sid, b.user_message("u1"))
        big = s.submit(sid, upsert_part=b.text_part("u1", "p-big", "x" * 200_000))
        after = s.submit(sid, upsert_part=b.text_part("u1", "p-after", "small"))
        for future, seq in ((big, 3), (after, 4)):
            with pytest.raises(CompactdError) as e:
                future.result(timeout=10)
            assert e.value.stream_ended, e.value
            assert e.value.seq == seq, e.value
            assert e.value.code_name == "RESOURCE_EXHAUSTED", e.value
            assert "outcome is unknown" in str(e.value), e.value
    # A refusal of the update itself, on an open stream, is no such error.
    with Client(small_updates.addr, timeout=10) as c, c.stream() as s:
        s.open(sid + "-2")
        with pytest.raises(NotFound) as e:
            s.upsert_part("no-such-session", b.text_part("u1", "p", "x"))
        assert not e.value.stream_ended


def _depth(err: BaseException) -> int:
    return len(traceback.extract_tb(err.__traceback__))


def _assert_says_the_stream_ended(err: CompactdError, first: CompactdError) -> None:
    """An update sent after the stream ended: a fresh error, flagged, naming the failure."""
    assert err is not first, "the stream's stored error raised again"
    assert err.stream_ended and err.seq is None, err
    assert err.code_name == "RESOURCE_EXHAUSTED", err  # the stream's code
    assert "the stream ended" in err.message and "not sent" in err.message, err
    assert "max_update_bytes (65536 bytes)" in err.message, err  # the original failure


def test_updates_after_the_stream_ended_raise_a_new_error_saying_so(small_updates) -> None:
    # Every update sent after a failure raised the stream's stored error itself: no
    # stream_ended, no seq, as if that update had been refused for its own size (a host
    # skipping refused updates dropped all of them), its traceback growing on each raise.
    sid = "after-the-end"
    with Client(small_updates.addr, timeout=10) as c, c.stream() as s:
        s.open(sid)
        s.upsert_message(sid, b.user_message("u1"))
        with pytest.raises(CompactdError) as e:
            s.upsert_part(sid, b.text_part("u1", "p-big", "x" * 200_000))
        first = e.value
        assert first.stream_ended and first.seq == 3
        depths = set()
        for i in range(100):
            with pytest.raises(CompactdError) as e:
                s.upsert_part(sid, b.text_part("u1", f"p{i}", "y" * 100_000))
            _assert_says_the_stream_ended(e.value, first)
            depths.add(_depth(e.value))
            with pytest.raises(CompactdError) as e:
                s.submit(sid, upsert_part=b.text_part("u1", f"q{i}", "small"))
            _assert_says_the_stream_ended(e.value, first)
        assert len(depths) == 1, sorted(depths)


def test_async_updates_after_the_stream_ended_raise_a_new_error_saying_so(small_updates) -> None:
    async def main() -> None:
        sid = "after-the-end-async"
        async with AsyncClient(small_updates.addr, timeout=10) as c:
            s = await c.stream()
            await s.open(sid)
            await s.upsert_message(sid, b.user_message("u1"))
            with pytest.raises(CompactdError) as e:
                await s.upsert_part(sid, b.text_part("u1", "p-big", "x" * 200_000))
            first = e.value
            assert first.stream_ended and first.seq == 3
            depths = set()
            for i in range(100):
                with pytest.raises(CompactdError) as e:
                    await s.upsert_part(sid, b.text_part("u1", f"p{i}", "y" * 100_000))
                _assert_says_the_stream_ended(e.value, first)
                depths.add(_depth(e.value))
                with pytest.raises(CompactdError) as e:
                    await s.submit(sid, upsert_part=b.text_part("u1", f"q{i}", "small"))
                _assert_says_the_stream_ended(e.value, first)
            assert len(depths) == 1, sorted(depths)
            await s.close()

    asyncio.run(main())


def _text_for(sid: str, seq: int, part_id: str, size: int) -> str:
    """Text that makes the part's ClientUpdate (seq ``seq``) encode to ``size`` bytes."""
    n = size
    while pb.ClientUpdate(seq=seq, session_id=sid, upsert_part=b.text_part("u1", part_id, "z" * n)).ByteSize() > size:
        n -= 1
    return "z" * n


def _assert_refused_alone(err: CompactdError) -> None:
    assert isinstance(err, ResourceExhausted) and not err.stream_ended and err.seq is None, err
    assert "max_update_bytes" in err.message and "65536" in err.message, err


def test_an_update_over_max_update_bytes_is_refused_alone(small_updates) -> None:
    # The server refuses an update far past its --max-update-bytes at the transport, which
    # ends the whole stream (every session on it); the client checks the size first.
    sid = "over-the-limit"
    edge = _text_for(sid, 3, "p-edge", 65536)
    with Client(small_updates.addr, timeout=10, max_update_bytes=65536) as c, c.stream() as s:
        s.open(sid)
        s.upsert_message(sid, b.user_message("u1"))
        with pytest.raises(CompactdError) as e:
            s.upsert_part(sid, b.text_part("u1", "p-big", "x" * 200_000))
        _assert_refused_alone(e.value)
        with pytest.raises(CompactdError) as e:
            s.submit(sid, upsert_part=b.text_part("u1", "p-edge", edge + "z"))  # one byte over
        _assert_refused_alone(e.value)
        at_limit = s.upsert_part(sid, b.text_part("u1", "p-edge", edge))  # exactly the limit
        assert (at_limit.seq, at_limit.created) == (3, True)
        after = s.upsert_part(sid, b.text_part("u1", "p-after", "small"))
        assert (after.seq, after.created) == (4, True)
        parts = [p.id for p in c.get_session(sid).messages[0].parts]
        assert parts == ["p-edge", "p-after"]


def test_async_an_update_over_max_update_bytes_is_refused_alone(small_updates) -> None:
    async def main() -> None:
        sid = "over-the-limit-async"
        edge = _text_for(sid, 3, "p-edge", 65536)
        async with AsyncClient(small_updates.addr, timeout=10, max_update_bytes=65536) as c:
            async with await c.stream() as s:
                await s.open(sid)
                await s.upsert_message(sid, b.user_message("u1"))
                with pytest.raises(CompactdError) as e:
                    await s.upsert_part(sid, b.text_part("u1", "p-big", "x" * 200_000))
                _assert_refused_alone(e.value)
                with pytest.raises(CompactdError) as e:
                    await s.submit(sid, upsert_part=b.text_part("u1", "p-edge", edge + "z"))
                _assert_refused_alone(e.value)
                at_limit = await s.upsert_part(sid, b.text_part("u1", "p-edge", edge))
                assert (at_limit.seq, at_limit.created) == (3, True)
                after = await s.upsert_part(sid, b.text_part("u1", "p-after", "small"))
                assert (after.seq, after.created) == (4, True)
            parts = [p.id for p in (await c.get_session(sid)).messages[0].parts]
            assert parts == ["p-edge", "p-after"]

    asyncio.run(main())


def test_the_default_max_update_bytes_is_the_servers_default() -> None:
    from compactd_client.stream import DEFAULT_MAX_UPDATE_BYTES

    assert DEFAULT_MAX_UPDATE_BYTES == 16 * 1024 * 1024
    with Client("127.0.0.1:1") as c:
        assert c._max_update_bytes == DEFAULT_MAX_UPDATE_BYTES


def test_field_prefixes_are_read_as_the_typescript_client_reads_them() -> None:
    from compactd_client.errors import split_field

    # An import's JSON path may hold any key (src/trace/import.rs names it).
    assert split_field("export_json.$.messages[2].my-key: not a string") == (
        "export_json.$.messages[2].my-key",
        "not a string",
    )
    assert split_field("session.id: required") == ("session.id", "required")
    assert split_field("session s1 was deleted: subscribe again") == (
        "",
        "session s1 was deleted: subscribe again",
    )
