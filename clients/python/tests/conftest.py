"""Fixtures: one real compactd for the module's tests, a client on it, fresh session ids."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path
from typing import Iterator

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compactd_server import REPO, Server  # noqa: E402

from compactd_client import Client  # noqa: E402


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    """compactd with its defaults (no LLM endpoint), sessions in memory."""
    srv = Server()
    yield srv
    srv.stop()


@pytest.fixture()
def client(server: Server) -> Iterator[Client]:
    with Client(server.addr, timeout=10) as c:
        yield c


@pytest.fixture()
def sid() -> str:
    """A session id no other test uses."""
    return f"py-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def example_export() -> str:
    """The repository's examples/session.json (an `opencode export` document)."""
    return (REPO / "examples" / "session.json").read_text()
