"""The bearer token (``--auth-token-file``): read as the server reads its file, and never
shown in an error."""

from __future__ import annotations

from pathlib import Path

import pytest

from compactd_client import AsyncClient, Client, Unauthenticated
from compactd_server import Server

TOKEN = "s3cret-token-for-the-python-client"


@pytest.fixture(scope="module")
def authed(tmp_path_factory: pytest.TempPathFactory):
    path: Path = tmp_path_factory.mktemp("auth") / "token"
    path.write_text(TOKEN + "\n")
    srv = Server(["--auth-token-file", str(path)])
    yield srv
    srv.stop()


def test_a_token_with_its_files_newline_is_the_servers_token(authed: Server) -> None:
    # A Kubernetes secret or `open(path).read()` keeps the newline: the server trims it.
    with Client(authed.addr, token=f"  {TOKEN}\n", timeout=10) as c:
        c.list_sessions()
    with Client(authed.addr, token="wrong", timeout=10) as c:
        with pytest.raises(Unauthenticated):
            c.list_sessions()


@pytest.mark.parametrize("make", [Client, AsyncClient])
def test_a_token_no_header_can_carry_is_refused_without_showing_it(authed: Server, make) -> None:
    with pytest.raises(ValueError) as e:
        make(authed.addr, token=TOKEN + "\x07inside")
    assert "token" in str(e.value)
    assert TOKEN not in str(e.value) and TOKEN not in repr(e.value)
