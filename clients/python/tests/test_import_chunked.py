"""A document past compactd's ``max_update_bytes`` imports in chunks (ImportSessionChunked),
from the sync and the asyncio client, as text, bytes or a dict."""

from __future__ import annotations

import asyncio
import json

import pytest

from compactd_client import AsyncClient, Client, ResourceExhausted
from compactd_server import REPO, Server, serve_sessions

TRACE = REPO / "tests" / "data" / "traces" / "claudecode-subagent-6633a783.json"
CAP = 65536


@pytest.fixture(scope="module")
def small_cap():
    """compactd refusing requests over 64 KiB."""
    srv = Server(["--max-update-bytes", str(CAP)])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def trace() -> str:
    text = TRACE.read_text()
    assert len(text.encode()) > 4 * CAP
    return text


def test_a_document_past_the_cap_is_refused_whole_and_imports_in_chunks(small_cap, trace: str) -> None:
    messages = len(json.loads(trace)["messages"])
    with Client(small_cap.addr, timeout=30) as c:
        with pytest.raises(ResourceExhausted) as e:
            c.import_session(trace, session_id="whole", chunk_bytes=0)
        assert "max_update_bytes" in str(e.value)
        summaries = [
            c.import_session(doc, session_id=f"py-chunked-{n}", chunk_bytes=CAP // 2)
            for n, doc in enumerate((trace, trace.encode(), json.loads(trace)))
        ]
        for s in summaries:
            assert s.messages == messages, s
            assert s.parts == summaries[0].parts
            assert s.estimated_tokens == summaries[0].estimated_tokens
        held = c.get_session("py-chunked-0")
        assert [m.info.id for m in held.messages] == [m["info"]["id"] for m in json.loads(trace)["messages"]]


def test_the_async_client_imports_in_chunks_too(small_cap, trace: str) -> None:
    async def main() -> None:
        async with AsyncClient(small_cap.addr, timeout=30) as c:
            s = await c.import_session(trace, session_id="py-async-chunked", chunk_bytes=CAP // 2, replace=True)
            assert s.messages == len(json.loads(trace)["messages"])

    asyncio.run(main())


def test_a_compactd_without_the_chunked_call_gets_the_document_whole(trace: str) -> None:
    """An older compactd answers ImportSessionChunked with UNIMPLEMENTED: the client sends
    the document whole instead, as it did before."""
    import grpc

    from compactd_client import pb

    seen = []

    def import_session(request: bytes, _context: grpc.ServicerContext) -> bytes:
        req = pb.ImportSessionRequest.FromString(request)
        seen.append(len(req.export_json))
        return pb.SessionSummary(id=req.session_id, messages=1).SerializeToString()

    addr, server = serve_sessions(
        {"ImportSession": grpc.unary_unary_rpc_method_handler(import_session)}
    )
    try:
        with Client(addr, timeout=10) as c:
            s = c.import_session(trace, session_id="old", chunk_bytes=CAP // 2)
        assert s.id == "old"
        assert seen == [len(trace)]
    finally:
        server.stop(grace=None)


@pytest.mark.parametrize("bad", [-1, 1.5, "4096", True])
def test_chunk_bytes_is_checked(bad) -> None:
    with Client("127.0.0.1:1", timeout=1) as c:
        with pytest.raises(ValueError, match="chunk_bytes"):
            c.import_session("{}", chunk_bytes=bad)
