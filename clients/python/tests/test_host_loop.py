"""examples/host_loop.py against a scripted fake endpoint: every request it sends is
compactd's context, and after a prune a cleared output reads as the placeholder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from compactd_client import Client
from fake_openai import FakeOpenAI, Reply

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "host_loop.py"
PLACEHOLDER = "[Old tool result content cleared]"


def test_host_loop_sends_compactds_context(server, sid: str, tmp_path: Path) -> None:
    log = tmp_path / "build.log"
    log.write_text("".join(f"build step {i}: compiling module_{i}.rs ok\n" for i in range(300)))
    fake = FakeOpenAI([
        # turn 1: read a long build log, then answer
        Reply.calls({"id": "call_read", "name": "read_file", "arguments": {"path": str(log)}}, usage=(500, 20)),
        Reply.text("The build log is fine.", usage=(3500, 10)),
        # turn 2: a shell command
        Reply.calls({"id": "call_sh1", "name": "run_shell", "arguments": {"command": "echo hello-from-shell"}}, usage=(3600, 20)),
        Reply.text("It printed hello.", usage=(3700, 10)),
        # turn 3: another command; the finished step prunes turn 1's read
        Reply.calls({"id": "call_sh2", "name": "run_shell", "arguments": {"command": "echo again"}}, usage=(3800, 20)),
        Reply.text("Done.", usage=(1000, 5)),
    ])
    try:
        cmd = [sys.executable, str(EXAMPLE), "--compactd", server.addr, "--base-url", fake.base_url,
               "--model", "fake-model", "--session", sid, "--context", "128000", "--output", "8000",
               "--config", '{"prune_protect": 300, "prune_minimum": 100, "cache_model": "none"}',
               "Check the build log", "Say hello", "Run it again"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
        assert done.returncode == 0, done.stderr
        assert done.stdout.split("\n")[:3] == ["The build log is fine.", "It printed hello.", "Done."]
        reqs = fake.requests
        assert len(reqs) == 6 and not fake.script
    finally:
        fake.stop()

    body = log.read_text()
    for r in reqs:
        assert r.messages[0]["role"] == "system"
        assert {t["function"]["name"] for t in r.body["tools"]} == {"read_file", "run_shell", "compactd_recall"}
    # Request 2 carries the whole log as the read's tool result.
    tool_results = {m["tool_call_id"]: m["content"] for m in reqs[1].messages if m["role"] == "tool"}
    assert tool_results["call_read"] == body
    assert "hello-from-shell" in {m["tool_call_id"]: m["content"] for m in reqs[3].messages
                                   if m["role"] == "tool"}["call_sh1"]
    # Request 6 was sent after turn 3's first step pruned turn 1: the placeholder, not the log.
    last = {m["tool_call_id"]: m["content"] for m in reqs[5].messages if m["role"] == "tool"}
    assert last["call_read"] == PLACEHOLDER
    assert "build step 150" not in reqs[5].text()
    assert "build step 150" in reqs[4].text()  # before that prune it was still there

    with Client(server.addr) as c:
        final = c.openai_messages(sid)
        # Each request was exactly compactd's context at the time: the last one is the
        # final context minus the answer it produced.
        assert reqs[5].messages[1:] == final[:-1]
        assert final[-1] == {"role": "assistant", "content": "Done."}
        session = c.get_session(sid)
        finished = [m.info for m in session.messages if m.info.role == "assistant"]
        assert [m.finish for m in finished] == ["tool-calls", "stop"] * 3
        assert finished[0].tokens.input == 500 and finished[0].tokens.output == 20
        read = c.recall(sid, call_id="call_read")
        assert read.reduction == "cleared" and read.call.output == body
