"""Every unary RPC through the blocking Client, against the real binary."""

from __future__ import annotations

import json
import threading
import time

import grpc
import pytest

from compactd_client import (
    AlreadyExists,
    Client,
    NotFound,
    builders as b,
    pb,
)
from compactd_client.results import import_request

PLACEHOLDER = "[Old tool result content cleared]"


def seed_tool_turns(client: Client, sid: str, turns: int, output_chars: int) -> None:
    """``turns`` user turns, each answered with one finished `read` call."""
    for n in range(1, turns + 1):
        client.upsert_message(sid, b.user_message(f"u{n}"))
        client.upsert_part(sid, b.text_part(f"u{n}", f"u{n}-t", f"read file {n}"))
        client.upsert_message(sid, b.assistant_message(f"a{n}", f"u{n}"))
        client.upsert_part(sid, b.tool_part(
            f"a{n}", f"a{n}-read", call_id=f"call_{n}", tool="read",
            input={"path": f"src/file{n}.py"}, output=f"line of file {n}\n" * (output_chars // 15)))
        client.upsert_message(sid, b.assistant_message(f"a{n}", f"u{n}", finish="tool-calls",
                                                       tokens=b.tokens(1000 * n, 50)))


def test_open_then_reconfigure(client: Client, sid: str) -> None:
    first = client.open_session(sid, title="t1", model=("openai", "gpt-4.1"), limits=(16000, 4000),
                                config={"prune_protect": 2000, "protected_tools": ["skill", "task"]})
    assert first.created and first.id == sid and first.title == "t1"
    assert (first.limits.context, first.limits.output) == (16000, 4000)
    # usable = 16000 - min(4000, 32000); threshold = floor(12000 * 0.92)
    assert (first.overflow.usable, first.overflow.threshold) == (12000, 11040)
    again = client.open_session(sid, title="t2", limits={"context": 32000, "output": 8000})
    assert not again.created and again.title == "t2" and again.overflow.usable == 24000
    info = client.get_session(sid).info
    assert info.config.prune_protect == 2000
    assert list(info.config.protected_tools.values) == ["skill", "task"]
    assert info.model.model_id == "gpt-4.1"


def test_messages_parts_and_openai_context(client: Client, sid: str) -> None:
    client.open_session(sid, limits=(128000, 8000))
    assert client.upsert_message(sid, b.user_message("m1")).created
    res = client.upsert_part(sid, b.text_part("m1", "p1", "Fix the failing test"))
    assert (res.kind, res.created) == ("upsert_part", True)
    client.upsert_message(sid, b.assistant_message("m2", "m1"))
    client.upsert_part(sid, b.text_part("m2", "p2", "Reading it."))
    client.upsert_part(sid, b.tool_part("m2", "p3", call_id="call_a", tool="read",
                                        input={"path": "a.py"}, output="print(1)"))
    again = client.upsert_part(sid, b.text_part("m2", "p2", "Reading the test."))
    assert not again.created  # updated in place
    msgs = client.openai_messages(sid)
    assert msgs[0] == {"role": "user", "content": "Fix the failing test"}
    assert msgs[1]["role"] == "assistant" and msgs[1]["content"] == "Reading the test."
    call = msgs[1]["tool_calls"][0]
    assert call["id"] == "call_a" and call["function"]["name"] == "read"
    assert json.loads(call["function"]["arguments"]) == {"path": "a.py"}
    assert msgs[2] == {"role": "tool", "tool_call_id": "call_a", "content": "print(1)"}

    native = client.get_context(sid, pb.CONTEXT_FORMAT_NATIVE)
    assert [m.info.id for m in native.messages] == ["m1", "m2"]
    assert not native.HasField("openai_messages")
    assert native.estimated_tokens > 0 and native.session_messages == 2

    deleted = client.delete_part(sid, "m2", "p3")
    assert deleted.kind == "delete_part"
    assert "tool_calls" not in client.openai_messages(sid)[1]
    parts = [p.id for m in client.get_session(sid).messages for p in m.parts]
    assert parts == ["p1", "p2"]


def test_usage_overflow_and_check(client: Client, sid: str) -> None:
    client.open_session(sid, limits=(16000, 4000))
    client.upsert_message(sid, b.user_message("m1"))
    client.upsert_message(sid, b.assistant_message("m2", "m1"))
    calm = client.report_usage(sid, b.tokens(5000, 100, cache_read=1000), message_id="m2")
    assert calm.kind == "report_usage" and calm.overflow is None
    check = client.check_overflow(sid)
    assert not check.overflow and check.used == 6100 and check.counting == "input+cache.read+output"
    hot = client.report_usage(sid, b.tokens(11000, 100, cache_read=0))
    assert hot.overflow is not None and hot.overflow.overflow and hot.overflow.crossed == "used"
    assert client.check_overflow(sid).overflow


def test_prune_dry_run_then_commit(client: Client, sid: str) -> None:
    client.open_session(sid, limits=(128000, 8000),
                        config={"prune_protect": 500, "prune_minimum": 100, "prune": False,
                                "cache_model": "none"})
    seed_tool_turns(client, sid, turns=4, output_chars=6000)
    dry = client.prune(sid, dry_run=True)
    assert dry.dry_run and not dry.committed and dry.tokens_saved > 100
    assert PLACEHOLDER not in json.dumps(client.openai_messages(sid))
    real = client.prune(sid)
    assert real.committed and real.tokens_saved == dry.tokens_saved
    assert {p.call_id for p in real.parts} == {p.call_id for p in dry.parts}
    cleared = [m for m in client.openai_messages(sid) if m.get("content") == PLACEHOLDER]
    assert [m["tool_call_id"] for m in cleared] == sorted(p.call_id for p in real.parts)
    # The session still holds the original outputs (lazy deletion).
    stored = {p.tool.call_id: p for m in client.get_session(sid).messages for p in m.parts
              if p.WhichOneof("kind") == "tool"}
    for p in real.parts:
        assert stored[p.call_id].tool.state.output.startswith("line of file")
        assert stored[p.call_id].tool.state.time.HasField("compacted")


def test_pin_recall_and_recall_tool(client: Client, sid: str) -> None:
    client.open_session(sid, limits=(128000, 8000),
                        config={"prune_protect": 500, "prune_minimum": 100, "prune": False,
                                "cache_model": "none"})
    seed_tool_turns(client, sid, turns=4, output_chars=6000)
    assert client.prune(sid).committed
    back = client.recall(sid, call_id="call_1")
    assert back.reduction == "cleared" and back.call.tool == "read"
    assert back.call.output.startswith("line of file 1") and back.tokens > back.context_tokens
    assert client.recall(sid, part_id="a1-read").call.call_id == "call_1"

    client.pin(sid, "a1", "a1-read")
    assert client.recall(sid, call_id="call_1").pinned
    tool_msgs = {m["tool_call_id"]: m["content"] for m in client.openai_messages(sid)
                 if m["role"] == "tool"}
    assert tool_msgs["call_1"].startswith("line of file 1")  # pinned: verbatim again
    client.pin(sid, "a1", "a1-read", pinned=False)
    assert not client.recall(sid, call_id="call_1").pinned

    tool = client.recall_tool()
    assert tool["type"] == "function" and tool["function"]["name"] == "compactd_recall"
    assert tool["function"]["parameters"]["required"] == ["call_id"]


def test_list_pages_through_every_session(client: Client, sid: str) -> None:
    ids = [f"{sid}-{k}" for k in "ecadb"]
    for i in ids:
        client.open_session(i)
    try:
        paged = [s.id for s in client.list_sessions(page_size=2)]
        assert paged == [s.id for s in client.list_sessions()]
        assert [i for i in paged if i.startswith(sid + "-")] == sorted(ids)
        assert paged == sorted(paged)
        for bad in (-1, 0, 1.5, True, 2**31):
            with pytest.raises(ValueError, match="page_size"):
                client.list_sessions(page_size=bad)  # type: ignore[arg-type]
    finally:
        for i in ids:
            client.delete_session(i)


def test_list_get_delete(client: Client, sid: str) -> None:
    client.open_session(sid, title="listed")
    listed = {s.id: s for s in client.list_sessions()}
    assert listed[sid].title == "listed"
    full = client.get_session(sid)
    assert full.info.id == sid and full.summary.messages == 0
    assert client.delete_session(sid) is True
    assert sid not in {s.id for s in client.list_sessions()}
    with pytest.raises(NotFound) as e:
        client.get_session(sid)
    assert e.value.field == "session_id"


def test_import_text_and_dict(client: Client, sid: str, example_export: str) -> None:
    doc = json.loads(example_export)
    summary = client.import_session(example_export, session_id=sid, limits=(16000, 4000),
                                    config={"prune_protect": 2000, "prune_minimum": 1000})
    assert summary.id == sid and summary.messages == len(doc["messages"])
    with pytest.raises(AlreadyExists) as e:
        client.import_session(doc, session_id=sid)
    assert e.value.code == grpc.StatusCode.ALREADY_EXISTS and e.value.field == "session_id"
    replaced = client.import_session(doc, session_id=sid, replace=True)
    assert replaced.messages == summary.messages
    # Nothing compacted: keeping compactions keeps the export as it is.
    kept = client.import_session(doc, session_id=sid, replace=True, keep_compactions=True)
    assert kept.messages == summary.messages
    req = import_request(doc, sid, None, None, True, keep_compactions=True)
    assert req.replace and req.keep_compactions
    assert not import_request(doc, sid, None, None, True).keep_compactions
    # The walk-through's numbers: the example prunes with these settings.
    client.import_session(doc, session_id=sid, replace=True, limits=(16000, 4000),
                          config={"prune_protect": 2000, "prune_minimum": 1000})
    report = client.prune(sid)
    assert report.committed and report.parts


def test_subscribe_sees_overflow_from_another_client(server, client: Client, sid: str) -> None:
    client.open_session(sid, limits=(16000, 4000))
    got: list = []
    with client.subscribe(sid) as sub:
        reader = threading.Thread(target=lambda: got.extend(sub), daemon=True)
        reader.start()
        with Client(server.addr) as other:
            other.report_usage(sid, b.tokens(15000, 10))
        deadline = time.monotonic() + 15
        while not got and time.monotonic() < deadline:  # the assertion below says if none came
            time.sleep(0.05)
    reader.join(10)
    assert got and got[0].session_id == sid and got[0].WhichOneof("event") == "overflow"
    assert got[0].overflow.used == 15010


def test_subscribe_all_sessions(client: Client, sid: str) -> None:
    client.open_session(sid, limits=(16000, 4000))
    sub = client.subscribe()
    client.report_usage(sid, b.tokens(15000, 10))
    first = next(ev for ev in sub if ev.session_id == sid)
    sub.cancel()
    assert first.session_id == sid and first.overflow.overflow


def test_options_of_ones_own_keep_the_larger_message_limits(server, sid: str) -> None:
    # Before, any `options` replaced the client's defaults: a session past gRPC's 4 MiB
    # then failed on the client with RESOURCE_EXHAUSTED.
    with Client(server.addr, timeout=30, options=[("grpc.primary_user_agent", "host/1.0")]) as c:
        c.open_session(sid)
        c.upsert_message(sid, b.user_message("u1"))
        for n in range(5):
            c.upsert_part(sid, b.text_part("u1", f"t{n}", f"{n}" + "x" * (1 << 20)))
        held = c.get_session(sid)
        assert sum(len(p.text.text) for p in held.messages[0].parts) > 5 << 20
        c.delete_session(sid)
