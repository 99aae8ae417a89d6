"""
The tests' Salt 3007 minion shim (tests/support/salt3007/sitecustomize.py):
on 3007 a closed zeromq RequestClient refuses to connect again, as on Salt
3008.3; on the other lines it changes nothing.
"""

import asyncio
import importlib.util
import pathlib

import pytest
import salt.transport.zeromq
import salt.version
from salt.exceptions import SaltClientError

from tests.support import cluster

MAJOR = salt.version.__saltstack_version__.major


def load_shim():
    path = pathlib.Path(cluster.SALT3007_SHIM) / "sitecustomize.py"
    spec = importlib.util.spec_from_file_location("salt3007_shim", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def shim(monkeypatch):
    # put back whatever connect the shim replaces
    monkeypatch.setattr(salt.transport.zeromq.RequestClient, "connect",
                        salt.transport.zeromq.RequestClient.connect)
    return load_shim()


@pytest.mark.skipif(MAJOR != 3007, reason="the shim acts on Salt 3007 only")
def test_a_closed_request_client_does_not_connect_again(shim):
    async def scenario():
        client = salt.transport.zeromq.RequestClient(
            {"master_uri": "tcp://127.0.0.1:9"}, None)
        await client.connect()
        assert client.context is not None
        client.close()
        assert client.context is None
        with pytest.raises(SaltClientError, match="RequestClient is closed"):
            await client.connect()
        # nothing made that nobody closes
        assert client.context is None and client.socket is None

    assert shim.BACKPORTED is True
    asyncio.run(scenario())


@pytest.mark.skipif(MAJOR == 3007, reason="on Salt 3007 the shim acts")
def test_other_lines_are_left_alone(shim):
    before = salt.transport.zeromq.RequestClient.connect
    assert shim.BACKPORTED is False
    assert salt.transport.zeromq.RequestClient.connect is before
