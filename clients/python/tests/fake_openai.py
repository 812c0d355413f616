"""A scripted fake of an OpenAI-compatible chat-completions endpoint (http.server).

``FakeOpenAI(script)`` serves ``POST /v1/chat/completions`` on 127.0.0.1 (a free port)
from a background thread. Each request takes the next :class:`Reply` of the script and
is recorded (path, headers, JSON body). A streamed request (``"stream": true``, as
compactd's summarizer sends) gets server-sent events frame by frame like OpenAI's:
a role chunk, one chunk per text delta, a finish chunk, a usage chunk when
``stream_options.include_usage`` is set, then ``data: [DONE]``. Other requests get one
``chat.completion`` JSON object, with ``tool_calls`` when the reply has some.
``GET`` requests (compactd's window discovery) get 404.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, List, Optional, Sequence


@dataclass
class Reply:
    """One scripted answer: text (in ``chunks``), tool calls, or an HTTP error."""

    chunks: Sequence[str] = ()
    tool_calls: Sequence[Dict[str, Any]] = ()  # {"id", "name", "arguments": dict}
    # (prompt_tokens, completion_tokens); a prompt of None is counted from the request
    # (characters / 4), as a real endpoint reports what it read.
    usage: Optional[tuple] = (None, 10)
    status: int = 200
    delay: float = 0.0  # seconds before each streamed chunk

    @staticmethod
    def text(*chunks: str, usage: Optional[tuple] = (None, 10), delay: float = 0.0) -> "Reply":
        return Reply(chunks=chunks, usage=usage, delay=delay)

    @staticmethod
    def calls(*calls: Dict[str, Any], usage: Optional[tuple] = (None, 10)) -> "Reply":
        return Reply(tool_calls=calls, usage=usage)

    @staticmethod
    def error(status: int) -> "Reply":
        return Reply(status=status)


@dataclass
class Recorded:
    path: str
    headers: Dict[str, str]  # names in lower case
    body: Dict[str, Any] = field(default_factory=dict)

    @property
    def messages(self) -> List[Dict[str, Any]]:
        return self.body.get("messages", [])

    def text(self) -> str:
        """Every message content of the request, joined (for substring checks)."""
        return "\n".join(str(m.get("content") or "") for m in self.messages)


class FakeOpenAI:
    """The fake endpoint; ``base_url`` ends in ``/v1``. Stop it with :meth:`stop`."""

    def __init__(self, script: Sequence[Reply] = ()) -> None:
        self.script: List[Reply] = list(script)
        self.requests: List[Recorded] = []
        self._lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                self._send(404, {"error": {"message": "not served by the fake"}})

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                with fake._lock:
                    fake.requests.append(Recorded(
                        self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                    reply = fake.script.pop(0) if fake.script else Reply.error(500)
                if not self.path.endswith("/chat/completions"):
                    return self._send(404, {"error": {"message": "unknown path"}})
                if reply.status != 200:
                    return self._send(reply.status, {"error": {
                        "message": f"scripted {reply.status}", "type": "server_error"}})
                if body.get("stream"):
                    return self._stream(body, reply)
                self._send(200, fake._completion(body, reply))

            def _send(self, status: int, obj: Dict[str, Any]) -> None:
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _stream(self, body: Dict[str, Any], reply: Reply) -> None:
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("connection", "close")
                self.end_headers()
                model = body.get("model", "fake")
                usage_wanted = bool((body.get("stream_options") or {}).get("include_usage"))

                def frame(choices: List[Dict[str, Any]], usage: Any = None) -> None:
                    chunk = {"id": "chatcmpl-fake", "object": "chat.completion.chunk",
                             "created": int(time.time()), "model": model, "choices": choices}
                    if usage_wanted:
                        chunk["usage"] = usage
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()

                try:
                    frame([{"index": 0, "delta": {"role": "assistant", "content": ""},
                            "finish_reason": None}])
                    for text in reply.chunks:
                        if reply.delay:
                            time.sleep(reply.delay)
                        frame([{"index": 0, "delta": {"content": text}, "finish_reason": None}])
                    frame([{"index": 0, "delta": {}, "finish_reason": "stop"}])
                    if usage_wanted and reply.usage:
                        p, c = reply.usage
                        if p is None:
                            p = sum(len(str(m.get("content") or "")) for m in body.get("messages") or []) // 4
                        frame([], {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c})
                    self.wfile.write(b"data: [DONE]\n\n")
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client went away (a cancelled compaction)
                self.close_connection = True

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def base_url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/v1"

    def push(self, *replies: Reply) -> None:
        """Appends replies to the script."""
        with self._lock:
            self.script.extend(replies)

    @staticmethod
    def _completion(body: Dict[str, Any], reply: Reply) -> Dict[str, Any]:
        message: Dict[str, Any] = {"role": "assistant", "content": "".join(reply.chunks) or None}
        finish = "stop"
        if reply.tool_calls:
            finish = "tool_calls"
            message["tool_calls"] = [
                {"id": c["id"], "type": "function",
                 "function": {"name": c["name"], "arguments": json.dumps(c.get("arguments", {}))}}
                for c in reply.tool_calls
            ]
        out: Dict[str, Any] = {
            "id": "chatcmpl-fake", "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model", "fake"),
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        }
        if reply.usage:
            p, c = reply.usage
            out["usage"] = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
        return out

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
