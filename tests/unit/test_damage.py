"""
A damaged state file never bricks replication (issue 36), without a daemon:
the real rounds of a sync (``salt_multimaster.rounds``) publish to the real
peer module (``_modules/multimaster_peer.py``, its wrapper included) over
temp dirs.  For every state file of each side in turn (the primary's
``cachedir/multimaster``, the peer host minion's, the peer master's), each
of: garbage, truncated, emptied, a directory in its place; then a change on
the primary and a sync: the peer equals the primary after at most two
syncs, no exception escapes, and the peer says what it rebuilt.  The same
runs on real daemons in tests/integration/test_damage.py.
"""

import contextvars
import importlib.util
import os
import pathlib
import shutil

import pytest
import salt.utils.yaml

from salt_multimaster import memory, protocol, rounds, statefile, sync
from tests.conftest import REPO
from tests.support.cluster import gen_keypair
from tests.unit import test_contract as contract
from tests.unit import test_rounds
from tests.unit.test_contract import CATS, CONFIG_KEYS, _assert_replica
from tests.unit.test_rounds import PEER, FakeSalt, _conf, _Job

pair, fake = contract.pair, test_rounds.fake  # over temp dirs (fixtures)

DAMAGES = ("garbage", "truncated", "empty", "directory")


def damage(path, how):
    """
    Damage the file ``path`` the way ``how`` says (as a disk error or ``echo
    >`` would); a socket (the change journal's) is replaced by a file.
    """
    data = path.read_bytes() if path.is_file() else b""
    if not path.is_file():
        path.unlink()
    if how == "garbage":
        path.write_bytes(os.urandom(max(len(data), 16)))
    elif how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "empty":
        path.write_bytes(b"")
    else:
        path.unlink()
        path.mkdir()
        (path / "x").write_bytes(b"x")


def state_files(*dirs):
    """
    One file of each kind under ``dirs`` (one bucket file stands for its
    directory's), backups, staging and what was moved aside left out.
    """
    kinds = {}
    for top in dirs:
        for dirpath, dirnames, files in os.walk(top):
            dirnames[:] = [d for d in dirnames if d not in ("backup", "stage")
                           and ".damaged-" not in d]
            for name in sorted(files):
                if ".damaged-" in name:
                    continue
                path = pathlib.Path(dirpath) / name
                kind = str(path.parent) if path.parent.name.endswith(".d") else str(path)
                kinds.setdefault(kind, path)
    return sorted(kinds.values())


def _read_whole(path):
    """
    Whether a sync reads the state file ``path`` whole every time (the
    bucket files are read when their bucket is needed; a lock's, a clock's
    or a restart's pid file's content is not read by a sync).
    """
    return not path.parent.name.endswith(".d") and path.suffix not in (".lock", ".clock",
                                                                       ".pending")


class PeerSalt(FakeSalt):
    """
    What the rounds ask of Salt (:class:`tests.unit.test_rounds.FakeSalt`),
    the publish answered by the real peer module loaded from its file, its
    Salt dunders stood in for (no sealing: it takes plain arguments too).
    """

    def __init__(self, tmp_path, primary_opts, mopts, minion_priv):
        minion = tmp_path / "m2-minion"
        super().__init__(primary_opts, mopts, minion_priv, minion / "multimaster")
        spec = importlib.util.spec_from_file_location(
            "mm_peer_damage", REPO / "_modules" / "multimaster_peer.py")
        self.mod = mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        conf = pathlib.Path(mopts["conf_file"])
        conf.write_text(salt.utils.yaml.safe_dump({
            key: mopts[key] for key in ("id", "pki_dir", "cachedir", "interface", "ret_port",
                                        "file_roots", "pillar_roots")}))
        (minion / "pki").mkdir(parents=True)
        (minion / "pki" / "minion.pem").write_bytes(minion_priv)
        mod.__opts__ = {"id": PEER, "cachedir": str(minion), "pki_dir": str(minion / "pki"),
                        "multimaster.master_config": str(conf),
                        "multimaster.master_restart_cmd": "true"}
        mod.__salt__ = {"cmd.run_bg": lambda script, **kwargs: {"pid": 0}}
        mod.__context__, mod.__grains__ = {}, {}
        mod._fetch = self.fetch
        mod._after_return = lambda work: work()

    def publish(self, peers, fun, request, timeout):
        assert peers == [PEER] and timeout > 0
        self.mod.__context__.clear()
        # the peer's job runs in a context of its own, as in its own process
        call = getattr(self.mod, fun.split(".")[1])
        return _Job(self, fun, contextvars.Context().run(call, **request))


@pytest.fixture
def world(fake, tmp_path):
    """test_rounds' primary and peer, the real peer module answering the publishes."""
    fake.primary_opts["nodegroups"] = {"webs": "L@web1"}
    return PeerSalt(tmp_path, fake.primary_opts, fake.mopts, fake.minion_priv)


def _sync(world, caplog, force=False):
    """One sync of the peer: its report (an exception, even one caught and logged, fails)."""
    caplog.clear()
    statefile.noticing()  # what the runner's wrapper does for its call
    ret = rounds.Rounds(world.primary_opts, _conf(), world, test=False, force=force).run(
        [PEER], list(CATS))
    res = ret[PEER]
    assert "Traceback" not in str(res), res
    raised = [r for r in caplog.records if r.exc_info]
    assert not raised, raised[0].getMessage() + str(raised[0].exc_info)
    return res


def _replica(world):
    try:
        _assert_replica(world.primary_opts, world.mopts)
    except AssertionError:
        return False
    return True


def test_every_damaged_state_file_converges_within_two_syncs(world, tmp_path, caplog):
    pki = tmp_path / "m1" / "pki" / "minions"
    res = _sync(world, caplog)
    assert res["result"] is True and _replica(world), res
    sides = [tmp_path / "m1" / "cache" / "multimaster", world.state_dir,
             tmp_path / "m2" / "cache" / "multimaster"]
    # the peer's memory on the primary and the drop-in the peer owns
    memory.remember(world.primary_opts, PEER, list(CATS),
                    sync.read_primary(world.primary_opts, list(CATS), "shared", CONFIG_KEYS),
                    {cat: {"envs": ["base"]} for cat in ("file_roots", "pillar_roots")}, res)
    files = state_files(*sides) + [pathlib.Path(protocol.dropin_path(world.mopts))]
    # the store of each side (the scans and the peer's memory; the peer's
    # records and key history), the peer's lock and restart markers, the drop-in
    assert len(files) >= 6 and [p.parent.name for p in files if p.name == "state.sqlite"] == [
        "multimaster", "multimaster"], files
    count, twice = 0, []
    for path in files:
        for how in DAMAGES:
            if not path.is_file():  # moved aside and not written again: a cache
                continue
            damage(path, how)
            count += 1
            (pki / f"new{count}").write_bytes(gen_keypair(1024)[1])
            (pki / f"new{count - 1}").unlink(missing_ok=True)  # a deletion too
            (tmp_path / "m1" / "srv" / f"f{count}.sls").write_text(f"{count}\n")
            first = _sync(world, caplog)
            if how in ("garbage", "directory") and _read_whole(path):
                # read at every sync: the report names it
                reported = (first.get("rebuilt") or []) + (first.get("primary_rebuilt") or [])
                assert any(r.startswith(f"{path}: ") for r in reported), (path, how, first)
            if not (first["result"] and _replica(world)):
                # the drop-in cut short or emptied still loads: options
                # removed on the peer, as an operator's edit would (issue
                # 33), named and kept; the force the report names converges
                edited = (path.name == protocol.DROPIN_NAME and how in ("truncated", "empty")
                          and first["master_config"].get("peer_changed"))
                second = _sync(world, caplog, force=bool(edited))
                assert second["result"] is True and _replica(world), (path, how, first, second)
                twice.append((path.name, how))
            if path.is_dir() and how == "directory":
                shutil.rmtree(path)
    assert count >= len(DAMAGES) * 6
