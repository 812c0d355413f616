"""A call that waits on the server with no deadline (a ``Subscribe``, a long compaction)
ends when the server stops answering: the channel pings while calls are open. Before, a
hung or unreachable compactd that never closed the connection (SIGSTOP, a network
partition to a shared compactd) held the call until TCP gave up, hours later."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

from compactd_client import AsyncClient, Client, CompactdError
from compactd_server import Server

# The default pings (every 20 s, 10 s to answer) end the call within ~30 s; the bound
# leaves a loaded machine room.
ENDS_WITHIN = 60.0


def test_a_subscription_to_a_server_that_stops_answering_ends() -> None:
    srv = Server()
    outcome: list = []
    try:
        with Client(srv.addr) as c:
            c.open_session("keepalive")
            sub = c.subscribe("keepalive")

            def watch() -> None:
                try:
                    for _ in sub:
                        pass
                    outcome.append("ended")
                except CompactdError as e:
                    outcome.append(e)

            t = threading.Thread(target=watch, daemon=True)
            t.start()
            srv.proc.send_signal(signal.SIGSTOP)
            began = time.monotonic()
            t.join(ENDS_WITHIN)
            assert not t.is_alive(), f"the subscription still waits after {ENDS_WITHIN} s"
            assert isinstance(outcome[0], CompactdError), outcome
            assert outcome[0].code_name == "UNAVAILABLE", outcome[0]
            assert time.monotonic() - began >= 10, "ended by the pings, not at once"
            sub.cancel()
    finally:
        srv.proc.send_signal(signal.SIGCONT)
        srv.stop()


def test_an_async_subscription_to_a_server_that_stops_answering_ends() -> None:
    srv = Server()

    async def watch() -> CompactdError:
        async with AsyncClient(srv.addr) as c:
            await c.open_session("keepalive")
            sub = await c.subscribe("keepalive")
            srv.proc.send_signal(signal.SIGSTOP)
            try:
                async for _ in sub:
                    pass
            except CompactdError as e:
                return e
            raise AssertionError("the subscription ended without an error")

    try:
        error = asyncio.run(asyncio.wait_for(watch(), ENDS_WITHIN))
        assert error.code_name == "UNAVAILABLE", error
    finally:
        srv.proc.send_signal(signal.SIGCONT)
        srv.stop()
