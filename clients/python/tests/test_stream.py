"""The Stream RPC through SessionStream: seqs, acks, the events each update caused,
pipelining, and every stream update."""

from __future__ import annotations

import json

import pytest

from compactd_client import Client, builders as b, pb

PLACEHOLDER = "[Old tool result content cleared]"
CONFIG = {"prune_protect": 500, "prune_minimum": 100, "cache_model": "none"}


def tool_turn(s, sid: str, n: int, chars: int, finish: bool = True):
    """One user turn answered by one `read` call; returns the finishing update's result."""
    s.upsert_message(sid, b.user_message(f"u{n}"))
    s.upsert_part(sid, b.text_part(f"u{n}", f"u{n}-t", f"turn {n}"))
    s.upsert_message(sid, b.assistant_message(f"a{n}", f"u{n}"))
    s.upsert_part(sid, b.tool_part(f"a{n}", f"a{n}-p", call_id=f"call_{n}", tool="read",
                                   input={"path": f"f{n}"}, output=f"content {n} " * (chars // 10)))
    return s.upsert_message(sid, b.assistant_message(f"a{n}", f"u{n}", finish="tool-calls"))


def test_seqs_and_acks(client: Client, sid: str) -> None:
    with client.stream() as s:
        opened = s.open(sid, limits=(16000, 4000), config={"threshold": 0.5})
        assert (opened.seq, opened.kind, opened.created) == (1, "open", True)
        assert not s.open(sid).created and s.open(sid).seq == 3
        assert s.upsert_message(sid, b.user_message("m1")).seq == 4
    assert client.get_session(sid).info.config.threshold == 0.5


def test_pipelined_updates_ack_in_order(client: Client, sid: str) -> None:
    with client.stream() as s:
        s.open(sid)
        s.upsert_message(sid, b.user_message("m1"))
        futures = [s.submit(sid, upsert_part=b.text_part("m1", f"p{i}", f"text {i}"))
                   for i in range(50)]
        results = [f.result(10) for f in futures]
        assert [r.seq for r in results] == list(range(3, 53))
        assert all(r.kind == "upsert_part" and r.created for r in results)
        ctx = s.get_context(sid, pb.CONTEXT_FORMAT_NATIVE)
        assert [p.id for p in ctx.messages[0].parts] == [f"p{i}" for i in range(50)]


def test_automatic_prune_event_comes_with_the_update(client: Client, sid: str) -> None:
    with client.stream() as s:
        s.open(sid, limits=(128000, 8000), config=CONFIG)
        results = [tool_turn(s, sid, n, 4000) for n in range(1, 5)]
        pruned = [r.pruned for r in results if r.pruned is not None]
        assert pruned, "a finished assistant message past two user turns should prune"
        assert pruned[0].committed and pruned[0].parts[0].call_id == "call_1"
        msgs = s.openai_messages(sid)
        tool_out = {m["tool_call_id"]: m["content"] for m in msgs if m["role"] == "tool"}
        assert tool_out["call_1"] == PLACEHOLDER
        assert tool_out["call_4"].startswith("content 4")


def test_usage_overflow_check_prune_pin_delete_on_the_stream(client: Client, sid: str) -> None:
    with client.stream() as s:
        s.open(sid, limits=(16000, 4000), config={**CONFIG, "prune": False})
        for n in range(1, 5):
            tool_turn(s, sid, n, 4000)
        usage = s.report_usage(sid, b.tokens(12000, 100), message_id="a4")
        assert usage.kind == "report_usage" and usage.overflow and usage.overflow.crossed == "used"
        check = s.check_overflow(sid)
        assert check.overflow and check.used == 12100 and check.trigger == "request"
        dry = s.prune(sid, dry_run=True)
        assert dry.dry_run and dry.tokens_saved > 0
        s.pin(sid, "a1", "a1-p")
        real = s.prune(sid)
        assert real.committed and "call_1" not in {p.call_id for p in real.parts}
        tool_out = {m["tool_call_id"]: m["content"] for m in s.openai_messages(sid) if m["role"] == "tool"}
        assert tool_out["call_1"].startswith("content 1")  # pinned
        assert tool_out["call_2"] == PLACEHOLDER
        gone = s.delete_part(sid, "a4", "a4-p")
        assert gone.kind == "delete_part"
        assert "call_4" not in json.dumps(s.openai_messages(sid))


def test_several_sessions_on_one_stream(client: Client, sid: str) -> None:
    other = sid + "-b"
    with client.stream() as s:
        s.open(sid)
        s.open(other)
        s.upsert_message(sid, b.user_message("m"))
        s.upsert_message(other, b.user_message("m"))
        s.upsert_part(sid, b.text_part("m", "p", "first"))
        s.upsert_part(other, b.text_part("m", "p", "second"))
        assert s.openai_messages(sid)[0]["content"] == "first"
        assert s.openai_messages(other)[0]["content"] == "second"


def test_closed_stream_refuses_updates(client: Client, sid: str) -> None:
    s = client.stream()
    s.open(sid)
    s.close()
    with pytest.raises(RuntimeError, match="closed"):
        s.open(sid)
    assert s.next_event(timeout=0.1) is None


def test_events_no_one_reads_are_kept_bounded(client: Client, sid: str) -> None:
    # Events after their update's ack (an automatic compaction's) that a host with no
    # on_event never reads: only the newest LATE_EVENTS_KEPT stay.
    from compactd_client.stream import LATE_EVENTS_KEPT

    with client.stream() as s:
        for n in range(1, 3 * LATE_EVENTS_KEPT + 1):
            s._dispatch(pb.ServerEvent(seq=1_000_000 + n, session_id=sid))  # as the reader routes one
        assert s._late.qsize() == LATE_EVENTS_KEPT
        first = s.next_event(timeout=1)
        assert first is not None and first.seq == 1_000_000 + 2 * LATE_EVENTS_KEPT + 1
        s.open(sid)  # the stream goes on


def test_submit_waits_for_room_while_the_server_is_stopped() -> None:
    """A host submitting faster than a stopped server reads holds at most MAX_UNSENT
    updates in the client; once the server runs again, every one of them is acked."""
    import signal
    import threading
    import time

    from compactd_client.stream import MAX_UNSENT
    from compactd_server import Server

    total = MAX_UNSENT + 300
    srv = Server()
    try:
        with Client(srv.addr, timeout=30) as c, c.stream() as s:
            sid = "backpressure"
            s.open(sid)
            s.upsert_message(sid, b.user_message("m1"))
            srv.proc.send_signal(signal.SIGSTOP)
            futures = []

            def host() -> None:
                for i in range(total):
                    text = f"{i:06d}" + "x" * (16 << 10)  # fills gRPC's windows quickly
                    futures.append(s.submit(sid, upsert_part=b.text_part("m1", f"p{i}", text)))

            t = threading.Thread(target=host, daemon=True)
            t.start()
            # The host blocks once the outbox is full: wait for the outbox to fill (a host
            # starved for a moment is not one that waits), then for it to stop moving.
            deadline = time.monotonic() + 20
            while s.unsent < MAX_UNSENT:
                assert time.monotonic() < deadline, f"the outbox never filled: {s.unsent} unsent"
                time.sleep(0.05)
            last, still = -1, 0
            while still < 10:
                time.sleep(0.1)
                n = len(futures)
                still = still + 1 if n == last else 0
                last = n
            assert t.is_alive() and len(futures) < total, "submit() never waited"
            assert s.unsent == MAX_UNSENT
            # send(timeout=) bounds its wait for room too (it waited for good), and the
            # update it gave up on was not sent (no seq taken: the acks below run on).
            from concurrent.futures import TimeoutError as FutureTimeout

            began = time.monotonic()
            with pytest.raises(FutureTimeout, match="send queue stayed full"):
                s.send(sid, timeout=1.0, upsert_part=b.text_part("m1", "late", "x"))
            assert time.monotonic() - began < 10
            srv.proc.send_signal(signal.SIGCONT)
            # The host ends once compactd has read all but MAX_UNSENT: a debug compactd reads
            # its first burst of 64 KiB updates slowly (30 a second on a loaded machine).
            t.join(120)
            assert not t.is_alive() and len(futures) == total
            acked = [f.result(30) for f in futures]
            assert [r.seq for r in acked] == list(range(3, total + 3))
            assert s.unsent == 0
    finally:
        srv.proc.send_signal(signal.SIGCONT)
        srv.stop()
