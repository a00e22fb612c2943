"""Shared fixtures of the tests that compare a remote Session with a local one: one user's token, one
`ie-lab serve demo` subprocess on loopback that accepts it (tests/test_remote.py's Server), one local eager
Session of the same model, and a client connected to the server. Each is module-scoped: a test module that
imports them gets its own server and sessions, as when each module defined them itself. The functions are named
*_fixture so that a test's `remote` argument shadows no imported name (pytest knows them by `name=`):

    from tests.remote_fixtures import local_fixture, remote_fixture, server_fixture, token_fixture  # noqa: F401
"""

from __future__ import annotations

import secrets

import pytest

import ie_lab
from tests.test_remote import Server, _write_tokens


@pytest.fixture(scope="module", name="token")
def token_fixture():
    return f"alice-{secrets.token_urlsafe(24)}"


@pytest.fixture(scope="module", name="server")
def server_fixture(tmp_path_factory, request, token):
    path = tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1]) / "tokens"
    _write_tokens(path, {"alice": token}, ["alice"])
    s = Server(path)
    yield s
    s.stop()


@pytest.fixture(scope="module", name="local")
def local_fixture():
    s = ie_lab.Session(ie_lab.DEMO_MODEL, backend="eager", progress=False, replace=False)
    yield s
    s.close()


@pytest.fixture(scope="module", name="remote")
def remote_fixture(server, token):
    s = ie_lab.connect(server.url, token=token, replace=False, progress=False)
    yield s
    s.close()
