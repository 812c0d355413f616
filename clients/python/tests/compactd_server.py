"""The real compactd binary as a child process, started on a free port.

The binary comes from ``$COMPACTD_BIN``; without it, the repository's
``target/debug/compactd`` or ``target/release/compactd`` (whichever exists), then
``compactd`` on PATH. It runs ``serve --listen 127.0.0.1:0 --log-format json
--durability memory`` and its address is read, as the Rust tests do
(tests/common/binary.rs), from the first JSON line on stderr with ``fields.listen``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import List, Optional, Sequence

REPO = Path(__file__).resolve().parents[3]


def compactd_bin() -> str:
    """The binary to test, or an AssertionError saying how to provide one."""
    env = os.environ.get("COMPACTD_BIN")
    if env:
        if not os.access(env, os.X_OK):
            raise AssertionError(f"COMPACTD_BIN={env} is not an executable file")
        return env
    for build in ("debug", "release"):
        cand = REPO / "target" / build / "compactd"
        if os.access(cand, os.X_OK):
            return str(cand)
    found = shutil.which("compactd")
    if found:
        return found
    raise AssertionError(
        "no compactd binary: set COMPACTD_BIN, or run `cargo build` in the repository root"
    )


class Server:
    """A running ``compactd serve``; ``addr`` is ``127.0.0.1:PORT``."""

    def __init__(self, args: Sequence[str] = (), env: Optional[dict] = None, timeout: float = 20.0):
        cmd = [compactd_bin(), "serve", "--listen", "127.0.0.1:0", "--log-format", "json",
               "--durability", "memory", *args]
        clean = {k: v for k, v in os.environ.items() if not k.startswith("COMPACTD_")}
        clean.update(env or {})
        self.log: List[str] = []
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     env=clean, text=True)
        self.addr = self._read_addr(timeout)
        self._drain = threading.Thread(target=self._drain_log, daemon=True)
        self._drain.start()

    def _read_addr(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)
            try:
                listen = json.loads(line).get("fields", {}).get("listen")
            except json.JSONDecodeError:
                listen = None
            if listen:
                return listen
            if time.monotonic() > deadline:
                break
        self.stop()
        raise AssertionError("compactd did not report its address; its log:\n" + "".join(self.log))

    def _drain_log(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:  # keeps the pipe from filling up
            self.log.append(line)

    def log_text(self) -> str:
        """Everything the server logged so far."""
        return "".join(self.log)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def serve_sessions(methods: dict) -> "tuple[str, object]":
    """A bare gRPC server answering only `methods` of ``compactd.v1.Sessions`` (name to
    ``grpc.*_rpc_method_handler``), started on a free port: its address and the server
    (``.stop(grace=None)`` when done). Every other method is UNIMPLEMENTED."""
    from concurrent import futures

    import grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("compactd.v1.Sessions", methods),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return f"127.0.0.1:{port}", server
