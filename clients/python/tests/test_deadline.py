"""A unary call has a deadline by default (30 s, as the TypeScript client's): a server that
takes the connection and never answers must not hold the caller forever."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Iterator

import grpc
import pytest

from compactd_client import AsyncClient, Client, CompactdError
from compactd_server import serve_sessions


@pytest.fixture()
def silent() -> Iterator[str]:
    """A gRPC server that takes every ListSessions call and never answers it (a stuck
    peer: the connection is up, the call is not)."""
    release = threading.Event()

    def hang(_request: bytes, _context: grpc.ServicerContext) -> bytes:
        release.wait()
        return b""

    addr, server = serve_sessions({"ListSessions": grpc.unary_unary_rpc_method_handler(hang)})
    yield addr
    release.set()
    server.stop(grace=None)


def test_a_unary_call_to_a_silent_server_ends_at_the_default_deadline(silent: str) -> None:
    began = time.monotonic()
    with Client(silent) as c:
        with pytest.raises(CompactdError) as e:
            c.list_sessions()
    took = time.monotonic() - began
    assert e.value.code_name == "DEADLINE_EXCEEDED", e.value
    assert 25 <= took <= 45, took


def test_an_async_unary_call_to_a_silent_server_ends_at_the_default_deadline(silent: str) -> None:
    async def call() -> CompactdError:
        async with AsyncClient(silent) as c:
            with pytest.raises(CompactdError) as e:
                await c.list_sessions()
            return e.value

    began = time.monotonic()
    error = asyncio.run(call())
    took = time.monotonic() - began
    assert error.code_name == "DEADLINE_EXCEEDED", error
    assert 25 <= took <= 45, took


def test_with_timeout_gives_one_call_its_own_deadline_on_the_same_channel(silent: str) -> None:
    with Client(silent, timeout=None) as c:
        short = c.with_timeout(0.5)
        began = time.monotonic()
        with pytest.raises(CompactdError) as e:
            short.list_sessions()
        assert e.value.code_name == "DEADLINE_EXCEEDED", e.value
        assert time.monotonic() - began < 10
        short.close()  # the copy does not own the channel
        assert c._timeout is None
        with pytest.raises(CompactdError) as e:
            c.with_timeout(0.5).list_sessions()
        assert e.value.code_name == "DEADLINE_EXCEEDED", e.value


def test_the_async_client_has_with_timeout_too(silent: str) -> None:
    async def call() -> CompactdError:
        async with AsyncClient(silent, timeout=None) as c:
            with pytest.raises(CompactdError) as e:
                await c.with_timeout(0.5).list_sessions()
            return e.value

    assert asyncio.run(call()).code_name == "DEADLINE_EXCEEDED"
