"""
``multimaster.status``'s row of one peer (``salt_multimaster.sync.peer_status``):
the real peer inventory over temp dirs against the real primary state.
"""

import socket

from salt_multimaster import daemon, peer, protocol, sync
from tests.support.cluster import gen_keypair

CATS = ["master_keys", "minion_keys", "file_roots"]


def _master(root, name, port):
    for sub in ("pki/minions", "pki/minions_pre", "srv", "cache"):
        (root / name / sub).mkdir(parents=True)
    return {"id": name, "pki_dir": str(root / name / "pki"), "cachedir": str(root / name / "cache"),
            "interface": "127.0.0.1", "ret_port": port, "hash_type": "sha256",
            "file_roots": {"base": [str(root / name / "srv")]}, "pillar_roots": {}}


def _pair(tmp_path, port):
    """A primary and a peer holding the same master keys and top.sls."""
    pair = _master(tmp_path, "m1", port), _master(tmp_path, "m2", port)
    priv, pub = gen_keypair(1024)
    for opts in pair:
        (tmp_path / opts["id"] / "pki" / "master.pem").write_bytes(priv)
        (tmp_path / opts["id"] / "pki" / "master.pub").write_bytes(pub)
        (tmp_path / opts["id"] / "srv" / "top.sls").write_text("base: {}\n")
    return pair


def _closed_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_peer_with_drift_and_its_master_down(tmp_path):
    primary_opts, peer_opts = _pair(tmp_path, _closed_port())
    (tmp_path / "m1" / "pki" / "minions" / "web1").write_bytes(gen_keypair(1024)[1])
    (tmp_path / "m1" / "srv" / "new.sls").write_text("new: {}\n")
    primary = sync.read_primary(primary_opts, CATS, "shared", [])
    inv = peer.inventory(peer_opts, str(tmp_path / "m2-state"), CATS,
                         sync.current_digests(primary, CATS), "shared", [])
    finger = inv["master_keys"]["fingerprint"]

    row = sync.peer_status("m2", inv, primary, ["minion_keys", "file_roots"], "shared",
                           finger, False)

    assert row == {
        "reachable": True,
        "master_finger": {"primary": finger, "peer": finger},
        "minion_keys": {"primary": primary["minion_keys"]["counts"],
                        "peer": inv["minion_keys"]["counts"]},
        "drift": {"minion_keys": {"added": 1, "updated": 0, "removed": 0, "conflicts": 0},
                  "file_roots": {"added": 1, "updated": 0, "removed": 0, "conflicts": 0}},
        "in_sync": False,
        "pull_allowed": False,
        "master_running": False,
        "restart_pending": inv["restart_pending"],
        "error": daemon.not_running_error("m2", inv["master_address"]),
        "pull_config": protocol.peer_run_snippet(["m2"]),
    }


def test_a_replica_whose_master_answers_is_in_sync(tmp_path):
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        primary_opts, peer_opts = _pair(tmp_path, port)
        primary = sync.read_primary(primary_opts, CATS, "shared", [])
        inv = peer.inventory(peer_opts, str(tmp_path / "m2-state"), CATS,
                             sync.current_digests(primary, CATS), "shared", [])
    row = sync.peer_status("m2", inv, primary, ["minion_keys", "file_roots"], "shared",
                           "f", True)
    assert (row["in_sync"], row["master_running"], row["pull_allowed"]) == (True, True, True)
    assert "error" not in row and "pull_config" not in row and "errors" not in row
