"""
Functional tests: the ``multimaster`` execution and state modules through
Salt's real loader (``saltfactories.utils.functional.Loaders``, as the
salt-extensions do), over a minion whose config files, pki_dir and cachedir
live in a temporary directory.  No daemon runs; states go through
``state.single`` and honour ``test=True``.
"""

import json
import shutil
import socket

import pytest
import salt.config
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from saltfactories.utils.functional import Loaders

from tests.conftest import REPO



def new_pub():
    """A new RSA public key, PEM text (a master key's public half)."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    ).decode()


@pytest.fixture(scope="module")
def masters():
    """
    Two "masters" that accept TCP connections (127.0.0.1 and 127.0.0.2, one
    listener on every address), and the ports: the audit connects to them.
    """
    listeners = []
    for _ in range(2):
        sock = socket.socket()
        sock.bind(("0.0.0.0", 0))
        sock.listen(16)
        listeners.append(sock)
    publish, request = (s.getsockname()[1] for s in listeners)
    yield {"masters": [f"127.0.0.1:{request}", f"127.0.0.2:{request}"],
           "publish_port": publish, "request_port": request}
    for sock in listeners:
        sock.close()


@pytest.fixture(scope="module")
def minion_root(tmp_path_factory):
    return tmp_path_factory.mktemp("minion")


@pytest.fixture(scope="module")
def minion_conf(minion_root, masters):
    """The main config file's text: two masters, HA settings, the temporary dirs."""
    return (
        "id: func-minion\n"
        f"master: {masters['masters']}\n"
        f"publish_port: {masters['publish_port']}\n"
        "master_alive_interval: 30\n"
        f"pki_dir: {minion_root / 'pki'}\n"
        f"cachedir: {minion_root / 'cache'}\n"
    )


def _fresh_minion(minion_root, minion_conf):
    """Empty config, pki, cache, states and pillar dirs; the main config file written."""
    for name in ("conf", "pki", "cache", "states", "pillar"):
        shutil.rmtree(minion_root / name, ignore_errors=True)
        (minion_root / name).mkdir()
    conf_dir = minion_root / "conf"
    (conf_dir / "minion.d").mkdir()
    (conf_dir / "minion").write_text(minion_conf)
    return conf_dir / "minion"


@pytest.fixture(scope="module")
def module_loaders(minion_root, minion_conf):
    """
    Salt's loaders for the temporary minion, with this repository's modules,
    built once per module (building them syncs and loads everything, a few
    seconds); ``loaders`` gives each test a fresh state of them.
    """
    conf_file = _fresh_minion(minion_root, minion_conf)
    opts = salt.config.minion_config(str(conf_file), minion_id="func-minion")
    opts.update({
        "conf_file": str(conf_file),
        "pki_dir": str(minion_root / "pki"),
        "cachedir": str(minion_root / "cache"),
        "extension_modules": str(minion_root / "cache" / "extmods"),
        "file_client": "local",
        "file_roots": {"base": [str(minion_root / "states")]},
        "pillar_roots": {"base": [str(minion_root / "pillar")]},
        "module_dirs": [str(REPO / "_modules")],
        "states_dirs": [str(REPO / "_states")],
        # a job is a thread of the minion: a background restart waits only its delay
        "multiprocessing": False,
    })
    return Loaders(opts, loaded_base_name=f"{__name__}.loaded")


@pytest.fixture
def loaders(module_loaders, minion_root, minion_conf):
    """
    Salt's loaders for a fresh temporary minion, a new state per test
    (nothing carries over between tests): the minion's dirs emptied and its
    config file rewritten, then every loader rebuilt from the options the
    module started with (``reload_all``: the context and the cache dir
    cleared, grains, pillar and modules loaded anew).
    """
    _fresh_minion(minion_root, minion_conf)
    module_loaders.reload_all()
    return module_loaders


@pytest.fixture
def minion(loaders, minion_root):  # pylint: disable=unused-argument
    """The temporary minion's paths."""
    conf_dir = minion_root / "conf"
    return {"conf_file": conf_dir / "minion", "conf_dir": conf_dir,
            "pki": minion_root / "pki", "root": minion_root,
            "dropin": conf_dir / "minion.d" / "multimaster.conf",
            "state_dir": minion_root / "cache" / "multimaster"}


@pytest.fixture
def pillar(loaders, minion_root):
    """
    Give the minion a pillar (``multimaster.sls`` in its pillar_roots) and
    reload its modules, which then see it in ``__pillar__``.
    """

    def set_pillar(data):
        (minion_root / "pillar" / "top.sls").write_text("base:\n  '*':\n    - multimaster\n")
        (minion_root / "pillar" / "multimaster.sls").write_text(json.dumps(data))
        loaders.reload_all()

    return set_pillar


class _Lazy:
    """``loaders.<kind>.<module>`` looked up at each use (a reload replaces it)."""

    def __init__(self, loaders, kind, module):
        self._loaders, self._kind, self._module = loaders, kind, module

    def __getattr__(self, name):
        return getattr(getattr(getattr(self._loaders, self._kind), self._module), name)


@pytest.fixture
def mm(loaders):
    """The multimaster execution module."""
    return _Lazy(loaders, "modules", "multimaster")


@pytest.fixture
def mm_state(loaders):
    """The multimaster state module (through state.single)."""
    return _Lazy(loaders, "states", "multimaster")
