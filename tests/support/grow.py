"""
A fleet that grows: a :class:`tests.support.cluster.Cluster` whose peer
masters are built but not started, as a new master host is before
``salt-run multimaster.add_peer`` (its salt-master installed, never started;
its salt-minion a minion of the primary).  Ordinary minions list the primary
only until the formula gives them the new master.
"""

import json
import pathlib

import salt.utils.yaml


def set_minion_masters(minion, masters):
    """Rewrite the master list in a (stopped) minion's own config file."""
    path = pathlib.Path(minion.config_file)
    conf = salt.utils.yaml.safe_load(path.read_text())
    conf["master"] = list(masters)
    path.write_text(salt.utils.yaml.safe_dump(conf))


def start_primary_only(cluster):
    """
    Seed every minion key on the primary alone, start the primary and every
    minion; the peers' masters stay stopped (never started: no key).
    """
    for minion in cluster.all_minions:
        cluster.seed_key(cluster.primary, minion)
    for minion in cluster.minions:
        set_minion_masters(minion, [cluster.primary.config["interface"]])
    cluster.primary.start()
    for minion in cluster.all_minions:
        minion.start()
    return cluster


def write_pillar(pillar_root, minion_ids, masters, marker):
    """
    Pillar ``multimaster`` for ``minion_ids``: the master list the formula
    writes, and a restart command that only leaves ``marker`` (no service
    manager here: the test restarts the minion itself).
    """
    pillar_root = pathlib.Path(pillar_root)
    pillar_root.mkdir(parents=True, exist_ok=True)
    targets = "\n".join(f"  '{mid}':\n    - multimaster" for mid in minion_ids)
    (pillar_root / "top.sls").write_text(f"base:\n{targets}\n")
    (pillar_root / "multimaster.sls").write_text(json.dumps({"multimaster": {
        "masters": list(masters),
        "minion": {"master_alive_interval": 10},
        "minion_restart_cmd": f"touch {marker}",
        "minion_restart_delay": 0,
    }}))


def dropin(master):
    """The primary's multimaster-peers.conf (add_peer's drop-in)."""
    return pathlib.Path(master.config_file).parent / "master.d" / "multimaster-peers.conf"
