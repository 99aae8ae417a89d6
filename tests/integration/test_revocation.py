"""
Revocation reaches every master (issue 33, items 1 and 2), on real daemons.

One cluster ``rvk``: a primary with the ``salt/key`` reactor (configured as
``salt.multimaster.master`` writes it, the repository as its file_roots
root), one peer, five minions listing both masters.  ``rvk-minion1`` is the
control; each test revokes minions of its own, so no test leans on another.

Every master runs ``loop_interval: 2``.  Evidence that a revoked minion
runs nothing the peer publishes after the sync plus that interval: once
the peer's master rotated its AES key (its ``key`` event
``rotate_aes_key`` on its event bus), or ``loop_interval`` plus 10 s of
slack for a loaded machine passed, the peer publishes a ``cmd.run`` that
creates a file per minion to a glob matching the control and the revoked
minions; the control's file appears, the revoked ones' do not.  The
minions run with ``rejected_retry: True``: a stock minion whose key is
rejected exits when it signs in again (the primary's own rotation after
``salt-key -r`` makes it), which would hide a peer that never rotated; a
compromised minion need not exit.  With the drop file write disabled,
every revoked minion here runs the peer's job.
"""

import pathlib
import time

import pytest
import salt.utils.yaml

from tests.integration.test_formula import IGNORE
from tests.support.cluster import gen_keypair, wait_until

pytestmark = pytest.mark.daemons

LOOP_INTERVAL = 2
CONTROL = "rvk-minion1"
# how long a revoked minion is given to run a job the control ran
NOT_RUN_WITHIN = 6


@pytest.fixture(scope="module")
def cluster(cluster_factory, repo_tree, mm_root):
    cluster = cluster_factory(
        "rvk",
        peers=1,
        minions=5,
        master_overrides={"loop_interval": LOOP_INTERVAL},
        primary_overrides={
            "file_roots": {"base": [str(repo_tree)]},
            "file_ignore_regex": IGNORE,
            # what salt.multimaster.master writes (tests/integration/test_formula.py)
            "reactor": [{"salt/key": ["salt://salt/multimaster/reactor/key.sls"]}],
        },
        minion_overrides={"rejected_retry": True},
    )
    dropin = pathlib.Path(cluster.primary.config_file).parent / "master.d" / "multimaster.conf"
    dropin.parent.mkdir(exist_ok=True)
    # a full sync here is one of the minion keys (the repository, as
    # file_roots, stays on the primary)
    dropin.write_text(salt.utils.yaml.safe_dump({"multimaster": {
        "peers": [m.id for m in cluster.peer_minions], "replicate": ["minion_keys"]}}))
    cluster.ran = mm_root / "rvk-ran"
    cluster.start()
    for minion in cluster.all_minions:
        assert cluster.wait_ping(cluster.primary, minion.id)
    # every key is pre-seeded on the peer too: this sync records that the
    # peer holds them as the primary does (its key history)
    ret = cluster.salt_run(cluster.primary, "multimaster.sync", "only=minion_keys")
    assert ret.returncode == 0, ret
    for minion in cluster.minions:
        assert cluster.wait_ping(cluster.peers[0], minion.id), minion.id
    yield cluster
    cluster.stop()


class Rotations:
    """
    The AES key rotations ``master`` fired on its event bus (tag ``key``,
    ``rotate_aes_key``) since this was made, as salt-factories' event
    listener received them: the master's engine forwards every event of its
    bus, the way Salt's own tests await events.  (A subscription of the
    test's own, read with short waits, lost events on a loaded machine:
    Salt 3007, a rotation the peer's minions showed and the bus never did.)
    """

    def __init__(self, master):
        self.master, self.since = master, time.time()

    def seen(self):
        events = self.master.event_listener.get_events([(self.master.id, "key")],
                                                       after_time=self.since)
        return sum(1 for event in events if event.data.get("rotate_aes_key"))


def _revoked_hear_nothing(cluster, tag, revoked, rotated):
    """
    Once the peer rotated (``rotated``: a :class:`Rotations` of the peer),
    at most its ``loop_interval`` and some slack from now, the peer
    publishes a job creating a file per minion to the control and
    ``revoked``: ``(control ran it, [revoked that ran it])``.
    """
    peer = cluster.peers[0]
    wait_until(lambda: rotated.seen() >= 1, deadline=LOOP_INTERVAL + 10, step=0.2)
    ran = cluster.ran / tag
    ran.mkdir(parents=True, exist_ok=True)
    tgt = f"{CONTROL[:-1]}[{CONTROL[-1]}{''.join(m[-1] for m in revoked)}]"
    ret = cluster.salt(peer, "cmd.run", f"touch {ran}/{{{{ grains['id'] }}}}", "template=jinja",
                       "--async", minion_tgt=tgt)
    assert ret.returncode == 0, ret
    control = wait_until(lambda: (ran / CONTROL).exists(), deadline=60)
    wait_until(lambda: any((ran / mid).exists() for mid in revoked), deadline=NOT_RUN_WITHIN)
    return control, sorted(mid for mid in revoked if (ran / mid).exists())


def _keys_of(cluster, master, mid):
    return sorted(state for state, keys in cluster.keys(master).items() if mid in keys)


def test_a_full_sync_revokes_on_the_peer(cluster):
    """
    Rejected and deleted on the primary (the key files moved and removed, no
    ``salt/key`` event: the reactor stays out), then ``salt-run
    multimaster.sync``: the peer's master rotates its AES key, and neither
    minion runs what the peer publishes.
    """
    peer, pm = cluster.peers[0], cluster.peer_minions[0]
    pki = cluster.pki_dir(cluster.primary)
    rejected, deleted = "rvk-minion2", "rvk-minion3"
    rotated = Rotations(peer)
    (pki / "minions" / rejected).rename(pki / "minions_rejected" / rejected)
    (pki / "minions" / deleted).unlink()
    ret = cluster.salt_run(cluster.primary, "multimaster.sync")
    assert ret.returncode == 0, ret
    res = ret.data[pm.id]
    assert sorted(res["minion_keys"]["removed"]) == sorted([f"minions/{rejected}",
                                                            f"minions/{deleted}"]), res
    assert res["aes_rotation"] == "requested", res
    control, ran = _revoked_hear_nothing(cluster, "full", [rejected, deleted], rotated)
    assert control, "the control minion did not run the peer's job"
    assert ran == [], f"revoked minions ran the peer's job: {ran}"
    assert rotated.seen() >= 1
    assert _keys_of(cluster, peer, rejected) == ["minions_rejected"]
    assert "minions" not in _keys_of(cluster, peer, deleted)


@pytest.mark.parametrize("act,mid", [("reject", "rvk-minion4"), ("delete", "rvk-minion5")])
def test_the_reactor_s_key_sync_revokes_on_the_peer(cluster, act, mid):
    """``salt-key -r``/``-d`` on the primary alone: the reactor's key sync reaches the peer."""
    peer = cluster.peers[0]
    rotated = Rotations(peer)
    args = ["-r", mid, "--include-accepted"] if act == "reject" else ["-d", mid]
    ret = cluster.salt_key(cluster.primary, *args, "-y")
    assert ret.returncode == 0, ret
    assert wait_until(lambda: "minions" not in _keys_of(cluster, peer, mid), deadline=120)
    control, ran = _revoked_hear_nothing(cluster, act, [mid], rotated)
    assert control, "the control minion did not run the peer's job"
    assert ran == [], f"{mid} ran the peer's job"
    assert rotated.seen() >= 1


def test_a_sync_never_accepts_a_key_rejected_on_the_peer(cluster):
    """
    A key accepted on the primary and rejected on the peer (``salt-key -r``
    there): full and targeted syncs name it (a change of the peer since its
    last sync), leave it rejected and exit non-zero; ``force=True`` accepts
    it there again.  (A rejection the peer holds from an earlier sync, the
    primary accepting the key again since: tests/integration/test_sync.py,
    the revoked conflict.)
    """
    peer, pm = cluster.peers[0], cluster.peer_minions[0]
    mid = "rvk-ghost"
    (cluster.pki_dir(cluster.primary) / "minions" / mid).write_bytes(gen_keypair(1024)[1])
    ret = cluster.salt_run(cluster.primary, "multimaster.sync", f"minion_ids={mid}")
    assert ret.returncode == 0, ret
    assert _keys_of(cluster, peer, mid) == ["minions"]
    ret = cluster.salt_key(peer, "-r", mid, "--include-accepted", "-y")
    assert ret.returncode == 0, ret
    for args in ([], [f"minion_ids={mid}"]):
        ret = cluster.salt_run(cluster.primary, "multimaster.sync", *args)
        assert ret.returncode != 0, (args, ret)
        res = ret.data[pm.id]
        assert res["result"] is False, (args, res)
        assert res["error"].startswith(f"1 item(s) changed on {pm.id} since its last sync"), (
            args, res)
        assert "force=True" in res["error"], (args, res)
        assert res["minion_keys"]["peer_changed"] == [
            f"minions_rejected/{mid}: rejected (was minions/{mid}) on the peer since its last "
            "sync (kept)"], (args, res)
        assert _keys_of(cluster, peer, mid) == ["minions_rejected"], args
    ret = cluster.salt_run(cluster.primary, "multimaster.sync", f"minion_ids={mid}", "force=True")
    assert ret.returncode == 0, ret
    assert _keys_of(cluster, peer, mid) == ["minions"]
    (cluster.pki_dir(cluster.primary) / "minions" / mid).unlink()
    ret = cluster.salt_run(cluster.primary, "multimaster.sync", f"minion_ids={mid}")
    assert ret.returncode == 0, ret
