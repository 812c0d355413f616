"""Bad input: the gRPC code and the field compactd names, on unary calls and on the
stream (where the field sits under the update's oneof name and the stream stays open)."""

from __future__ import annotations

from typing import Callable

import grpc
import pytest

from compactd_client import (
    Client,
    CompactdError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
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
