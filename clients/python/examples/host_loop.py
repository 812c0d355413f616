#!/usr/bin/env python3
"""A minimal agent host backed by compactd: the shortest path to writing your own.

For each user prompt it loops: ask compactd for the context (OpenAI chat messages), send
it to an OpenAI-compatible chat-completions endpoint with the tools below, and stream
everything that happens back into compactd over one ``Stream``: the user message and its
text, each assistant message (one per model request) with its text and tool calls, the
tool outputs, the provider's usage, and the finish. compactd prunes, masks and
supersedes old outputs as the session grows, so the next request is whatever it hands back.

Tools: ``read_file``, ``run_shell`` (runs a real command: use it in a sandbox) and
compactd's own ``compactd_recall``, which brings back an output compactd has hidden.

    pip install ./clients/python httpx==0.28.1
    compactd serve &                                  # 127.0.0.1:50051
    OPENAI_API_KEY=sk-... python clients/python/examples/host_loop.py \\
        --base-url https://api.openai.com/v1 --model gpt-4.1-mini \\
        "List the files here" "Read README.md and summarize it"

Environment: ``OPENAI_API_KEY`` (sent as a bearer token when set), ``COMPACTD_ADDR``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import uuid
from typing import Any, Dict, List

import httpx

from compactd_client import Client, SessionStream, builders as b

SYSTEM = "You are a coding agent. Use the tools to inspect files and run commands."
MAX_OUTPUT_CHARS = 200_000
TOOLS: List[Dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a text file.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                       "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "run_shell", "description": "Run a shell command; returns stdout and stderr.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                       "required": ["command"]}}},
]


def run_tool(client: Client, session_id: str, name: str, args: Dict[str, Any]) -> str:
    """Runs one tool call; raises on failure (the host records it as an error)."""
    if name == "read_file":
        with open(args["path"], encoding="utf-8", errors="replace") as f:
            return f.read(MAX_OUTPUT_CHARS)
    if name == "run_shell":
        done = subprocess.run(args["command"], shell=True, capture_output=True, text=True, timeout=60)
        return (done.stdout + done.stderr)[:MAX_OUTPUT_CHARS] + f"\n(exit {done.returncode})"
    if name == "compactd_recall":
        recalled = client.recall(session_id, call_id=args["call_id"])
        return recalled.call.output or recalled.call.error or recalled.text
    raise ValueError(f"unknown tool {name}")


class Host:
    """One agent session mirrored into compactd."""

    def __init__(self, client: Client, stream: SessionStream, http: httpx.Client, args: argparse.Namespace):
        self.client, self.stream, self.http, self.args = client, stream, http, args
        self.sid = args.session
        self.run = uuid.uuid4().hex[:8]  # ids unique across runs of the same session
        self.counter = 0
        self.tools = TOOLS + [client.recall_tool()]

    def new_id(self, kind: str) -> str:
        self.counter += 1
        return f"{kind}_{self.run}_{self.counter:04d}"

    def ask_model(self) -> Dict[str, Any]:
        """One chat-completions request whose messages are compactd's context."""
        messages = [{"role": "system", "content": SYSTEM}] + self.stream.openai_messages(self.sid)
        headers = {"authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"} if os.environ.get("OPENAI_API_KEY") else {}
        resp = self.http.post(f"{self.args.base_url}/chat/completions", headers=headers,
                              json={"model": self.args.model, "messages": messages, "tools": self.tools})
        resp.raise_for_status()
        return resp.json()

    def turn(self, prompt: str) -> str:
        """One user turn: model requests and tool calls until the model stops."""
        user_id = self.new_id("msg")
        self.stream.upsert_message(self.sid, b.user_message(user_id))
        self.stream.upsert_part(self.sid, b.text_part(user_id, self.new_id("prt"), prompt))
        for _ in range(self.args.max_steps):
            reply = self.ask_model()
            message = reply["choices"][0]["message"]
            tokens = b.tokens_from_openai(reply.get("usage") or {})
            aid = self.new_id("msg")
            self.stream.upsert_message(self.sid, b.assistant_message(aid, user_id))
            if message.get("content"):
                self.stream.upsert_part(self.sid, b.text_part(aid, self.new_id("prt"), message["content"]))
            self.stream.report_usage(self.sid, tokens, message_id=aid)
            calls = message.get("tool_calls") or []
            for call in calls:
                self.call_tool(aid, call)
            finish = "tool-calls" if calls else "stop"
            done = self.stream.upsert_message(self.sid, b.assistant_message(aid, user_id, finish=finish, tokens=tokens))
            if done.pruned is not None and done.pruned.committed:
                print(f"[compactd pruned {done.pruned.tokens_saved} tokens]", file=sys.stderr)
            if done.overflow is not None:
                print("[compactd: the context is about to overflow; compact it]", file=sys.stderr)
            if not calls:
                return message.get("content") or ""
        return ""

    def call_tool(self, aid: str, call: Dict[str, Any]) -> None:
        """Runs a tool call, mirroring it into compactd as running, then completed or error."""
        pid, name = self.new_id("prt"), call["function"]["name"]
        try:
            args = json.loads(call["function"].get("arguments") or "{}")
        except json.JSONDecodeError:
            args = {"raw": call["function"].get("arguments")}
        part = dict(call_id=call["id"], tool=name, input=args)
        self.stream.upsert_part(self.sid, b.tool_part(aid, pid, status="running", **part))
        try:
            output = run_tool(self.client, self.sid, name, args)
            self.stream.upsert_part(self.sid, b.tool_part(aid, pid, status="completed", output=output, **part))
        except Exception as e:  # noqa: BLE001 - a failed tool is the model's to handle
            self.stream.upsert_part(self.sid, b.tool_part(aid, pid, status="error", error=str(e), **part))


def main(argv: List[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("prompts", nargs="+", help="user turns, in order")
    p.add_argument("--compactd", default=os.environ.get("COMPACTD_ADDR", "127.0.0.1:50051"))
    p.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL", "https://api.openai.com/v1"))
    p.add_argument("--model", default="gpt-4.1-mini")
    p.add_argument("--session", default=f"host-{uuid.uuid4().hex[:8]}")
    p.add_argument("--context", type=int, default=128_000, help="the model's window (tokens)")
    p.add_argument("--output", type=int, default=16_000, help="the model's output limit")
    p.add_argument("--config", default="{}", help="per-session SessionConfig fields as JSON")
    p.add_argument("--max-steps", type=int, default=20)
    args = p.parse_args(argv)

    with Client(args.compactd) as client, client.stream() as stream, httpx.Client(timeout=300) as http:
        stream.open(args.session, model=("openai", args.model),
                    limits=(args.context, args.output), config=json.loads(args.config))
        host = Host(client, stream, http, args)
        for prompt in args.prompts:
            print(host.turn(prompt))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
