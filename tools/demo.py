"""
``make demo``: salt-multimaster on a throwaway sandbox.

Two masters (a primary and one peer, each on its own loopback address) and
three minions, all under a temporary directory; no system path is touched
and nothing is left running.  It shows the manual baseline of the field
reports (keys accepted on the primary only: the peer cannot reach the
minions), then ``salt-run multimaster.sync`` making the peer a replica, and
at the end a day without the primary: work done on the peer, named by the
sync when the primary returns, carried back by ``multimaster.failback``.
"""

import argparse
import contextlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "_utils"))

STEP = [0]


def say(text):
    STEP[0] += 1
    print(f"\n==> [{STEP[0]}] {text}", flush=True)


def prune(obj):
    """Drop empty lists and dicts, so a report shows what happened."""
    if isinstance(obj, dict):
        pruned = {k: prune(v) for k, v in obj.items()}
        return {k: v for k, v in pruned.items() if v not in ([], {}, None)}
    return obj


def show(cmd, ret):
    print(f"    $ {cmd}")
    out = ret.stdout.strip() if ret.stdout else ""
    try:
        out = json.dumps(prune(json.loads(out)), indent=2, sort_keys=True)
    except ValueError:
        pass
    print(textwrap.indent(out or "(no output)", "      "), flush=True)


def answers(cluster, master):
    """Minions answering test.ping through ``master``, and the exit code."""
    ret = cluster.salt(master, "test.ping", "--timeout=5", minion_tgt="demo-minion*", timeout=60)
    data = ret.data if isinstance(ret.data, dict) else {}
    return sorted(k for k, v in data.items() if v is True), ret


def all_answer(cluster, master, name):
    """Wait for every demo minion on ``master``, show who answers: True when all 3 do."""
    for minion in cluster.minions:
        cluster.wait_ping(master, minion.id, deadline=120)
    ok, ret = answers(cluster, master)
    show(f"salt -c {master.config_dir} 'demo-minion*' test.ping", ret)
    print(f"    {len(ok)} of 3 minions answer {name}.")
    return len(ok) == 3


def plant_faults(cluster, minion, primary):
    """A duplicate master entry (seed 002) and a stale cached master key."""
    from tests.support.cluster import gen_keypair  # pylint: disable=import-outside-toplevel

    conf = pathlib.Path(minion.config_file)
    text = conf.read_text()
    dup = f"- {primary.config['interface']}:4506"
    conf.write_text(text.replace("master:\n", f"master:\n{dup}\n", 1))
    cluster.restart(minion)
    pki = pathlib.Path(minion.config["pki_dir"])
    (pki / "minion_master.pub").write_bytes(gen_keypair(2048)[1])


def audit_and_formula(cluster, primary, peer):
    import salt.utils.yaml  # pylint: disable=import-outside-toplevel

    from tests.support.cluster import wait_until  # pylint: disable=import-outside-toplevel

    masters = [m.config["interface"] for m in cluster.masters]
    pillar_root = cluster.file_root(primary, kind="pillar_roots")
    (pillar_root / "top.sls").write_text("base:\n  'demo-minion*':\n    - multimaster\n")
    (pillar_root / "multimaster.sls").write_text(salt.utils.yaml.safe_dump({"multimaster": {
        "masters": masters,
        "master_finger": cluster.master_fingerprint(primary),
        "master_pub": (cluster.pki_dir(primary) / "master.pub").read_text(),
        "minion": {"master_alive_interval": 10},
        "minion_restart": False,   # no service manager here: the demo restarts them
    }}))
    cluster.salt(primary, "saltutil.refresh_pillar", minion_tgt="demo-minion*")
    bad = cluster.minions[0]
    # the AES key rotations the reactor's key deletion asked of both masters
    # happen first (each master's maintenance loop takes its drop file), and
    # the minion re-authenticates with the good key: after a rotation it
    # could not, with the stale key planted below
    wait_until(lambda: not any((pathlib.Path(m.config["cachedir"]) / ".dfn").exists()
                               for m in cluster.masters), deadline=180)
    for master in cluster.masters:
        cluster.wait_ping(master, bad.id, deadline=120)
    say(f"Planting two field-report faults on {bad.id}: the primary listed twice "
        f"({masters[0]} and {masters[0]}:4506) and a stale cached minion_master.pub.")
    plant_faults(cluster, bad, primary)
    cluster.wait_ping(primary, bad.id)

    say("The minion audit finds them (and every minion's missing master_alive_interval):")
    ret = cluster.salt(primary, "multimaster.audit", minion_tgt=bad.id)
    show(f"salt {bad.id} multimaster.audit", ret)
    print(f"    exit code {ret.returncode}")
    say("The fleet report, through the primary:")
    table(primary)

    say("Repairing: the stale key first (pillar cannot be verified with it), then the formula.")
    show(f"salt {bad.id} multimaster.master_key_apply",
         cluster.salt(primary, "multimaster.master_key_apply", minion_tgt=bad.id))
    ret = cluster.salt(primary, "state.apply", "salt.multimaster",
                       minion_tgt="demo-minion*", timeout=180)
    changed = sorted(
        f"{mid}: {state['__id__']}"
        for mid, states in (ret.data or {}).items() if isinstance(states, dict)
        for state in states.values() if isinstance(state, dict) and state.get("changes")
    )
    print("    $ salt 'demo-minion*' state.apply salt.multimaster")
    print(textwrap.indent("\n".join(changed) or "(no changes)", "      "))
    say("Restarting the minions to load their new drop-in (the formula does it by "
        "itself where a service manager runs).")
    for minion in cluster.minions:
        cluster.restart(minion)
    for minion in cluster.minions:
        for master in cluster.masters:
            cluster.wait_ping(master, minion.id, deadline=120)
    say("A second state.apply has nothing to change, and the fleet audit is clean:")
    ret = cluster.salt(primary, "state.apply", "salt.multimaster",
                       minion_tgt="demo-minion*", timeout=180)
    changed = [mid for mid, states in (ret.data or {}).items() if isinstance(states, dict)
               for state in states.values() if isinstance(state, dict) and state.get("changes")]
    print(f"    minions with changes: {sorted(set(changed)) or 'none'}")
    table(primary)


def plain(master, *args, cli="salt-run"):
    """A Salt CLI as an operator types it (no --out): its default output."""
    exe = os.path.join(os.path.dirname(sys.executable), cli)
    ret = subprocess.run([exe, "-c", str(master.config_dir), *args],
                         capture_output=True, text=True, check=False, timeout=300)
    print(f"    $ {cli} {' '.join(args)}")
    print(textwrap.indent(ret.stdout.rstrip() or ret.stderr.rstrip(), "      "))
    print(f"    exit code {ret.returncode}", flush=True)
    return ret


def table(master):
    """``salt-run multimaster.audit`` as an operator sees it: its compact table."""
    plain(master, "multimaster.audit")


def operators_day(cluster, primary, peer, peer_minion):
    """A changed file, a conflict, the reactor, a rollback: what an operator meets."""
    from tests.support.cluster import gen_keypair, wait_until  # pylint: disable=import-outside-toplevel

    motd = cluster.file_root(primary) / "motd.sls"
    old = motd.read_text()
    say("An operator edits a state on the primary; the sync replicates that one change:")
    motd.write_text("motd:\n  test.succeed_with_changes\n")
    plain(primary, "multimaster.sync")

    say("The motd edit was a mistake: roll the peer back from its backup (test=True "
        "first), then fix the primary and sync.")
    plain(primary, "multimaster.restore", f"peer={peer_minion.id}", "test=True")
    plain(primary, "multimaster.restore", f"peer={peer_minion.id}")
    print("    the peer's motd.sls is the old one again: "
          f"{(cluster.file_root(peer) / 'motd.sls').read_text() == old}")
    motd.write_text(old)
    plain(primary, "multimaster.sync")

    say("Someone accepted another key for demo-minion1 by hand on the peer: the sync "
        "names it (changed on the peer since its last sync), leaves the peer's key alone and "
        "exits non-zero (a cron job alerts); force=True makes the peer mirror the primary.")
    stray = cluster.pki_dir(peer) / "minions" / "demo-minion1"
    good = stray.read_bytes()
    stray.unlink()  # as salt-key -d, then -a of another key, would
    stray.write_bytes(gen_keypair(1024)[1])
    plain(primary, "multimaster.sync", "only=minion_keys")
    plain(primary, "multimaster.sync", "only=minion_keys", "force=True")
    print(f"    the peer holds the primary's key again: {stray.read_bytes() == good}")

    say("The reactor (salt.multimaster.master) carries a salt-key -a on the primary to "
        "the peer by itself:")
    pre = cluster.pki_dir(primary) / "minions_pre"
    pre.mkdir(exist_ok=True)
    (pre / "demo-new1").write_bytes(gen_keypair(1024)[1])
    plain(primary, "-a", "demo-new1", "-y", cli="salt-key")
    arrived = wait_until(
        lambda: (cluster.pki_dir(peer) / "minions" / "demo-new1").exists(), deadline=60)
    print(f"    demo-new1 accepted on the peer: {arrived}")
    plain(primary, "-d", "demo-new1", "-y", cli="salt-key")
    gone = wait_until(
        lambda: not (cluster.pki_dir(peer) / "minions" / "demo-new1").exists(), deadline=60)
    print(f"    ... and its deletion too: demo-new1 gone from the peer: {gone}")


def add_peer_act(cluster, factories, primary):
    """
    A third master joins: its host's minion is a minion of the primary, its
    salt-master installed and never started.  The pillar names it, add_peer
    checks the host, places the keys before its first start and configures
    it, and the formula gives every minion the new master.
    """
    # pylint: disable=import-outside-toplevel
    import salt.utils.yaml

    from tests.support.cluster import PUBLISH_PORT, RET_PORT, _noop_auth_event

    address = f"{cluster.prefix}.4"
    new = factories.salt_master_daemon(
        "demo-peer2", on_auth_event_callback=_noop_auth_event, start_timeout=120,
        overrides={"interface": address, "publish_port": PUBLISH_PORT, "ret_port": RET_PORT})
    new_minion = cluster._minion(  # pylint: disable=protected-access
        "demo-peer2", [primary], {"multimaster.master_config": str(new.config_file)})
    cluster.seed_key(primary, new_minion)
    cluster.peers.append(new)
    cluster.peer_minions.append(new_minion)
    say(f"A new master host joins: its minion demo-peer2 (accepted on the primary) and a "
        f"salt-master installed on {address}, never started.  First the pillar lists it:")
    new_minion.start()
    cluster.wait_ping(primary, new_minion.id)
    pillar = cluster.file_root(primary, kind="pillar_roots") / "multimaster.sls"
    data = salt.utils.yaml.safe_load(pillar.read_text())
    data["multimaster"]["masters"].append(address)
    pillar.write_text(salt.utils.yaml.safe_dump(data))
    print(f"    multimaster:masters: {data['multimaster']['masters']}")
    cluster.salt(primary, "saltutil.refresh_pillar", "wait=True", minion_tgt="demo-minion*")

    say("The plan (test=True changes nothing): which minions will get the new master.")
    plain(primary, "multimaster.add_peer", "demo-peer2", "test=True")
    say("Adding it: the keys are placed before its first start (no service manager in "
        "this sandbox, so add_peer says to start it and exits non-zero).")
    plain(primary, "multimaster.add_peer", "demo-peer2")
    new.start()
    plain(primary, "multimaster.status", "peers=demo-peer2")

    say("The formula gives every minion the new master; they restart to load it.")
    ret = cluster.salt(primary, "state.apply", "salt.multimaster",
                       minion_tgt="demo-minion*", timeout=180)
    print(f"    state.apply exit code {ret.returncode}")
    for minion in cluster.minions:
        cluster.restart(minion)
    return all_answer(cluster, new, "the new master")


def outage_act(cluster, primary, peer, peer_minion):
    """
    While the primary is down the operator works on the peer; the primary
    returns, the sync names that work and reverts nothing, failback carries
    it back.  Returns whether the masters agree and the rejected minion
    answers no master.
    """
    from tests.support.cluster import wait_until  # pylint: disable=import-outside-toplevel

    rejected = cluster.minions[2]
    say(f"The primary is down: the operator works on the peer.  {rejected.id} is compromised: "
        "rejected there; and motd.sls gets a hot-fix in the peer's file_roots.")
    plain(peer, "-r", rejected.id, "--include-accepted", "-y", cli="salt-key")
    hotfix = "motd:\n  test.succeed_with_changes:\n    - name: hot-fixed during the outage\n"
    (cluster.file_root(peer) / "motd.sls").write_text(hotfix)

    say("The primary returns.  The sync reverts nothing: it names both changes of the peer "
        "(peer_changed), says which command carries them back, and exits non-zero.")
    primary.start()
    for pm in cluster.peer_minions:
        cluster.wait_ping(primary, pm.id)
    plain(primary, "multimaster.sync")

    say("failback test=True shows what the peer changed and changes nothing; failback "
        "carries it to the primary (the key rejected there too, its AES key rotated), then "
        "syncs every peer.")
    plain(primary, "multimaster.failback", f"peer={peer_minion.id}", "test=True")
    plain(primary, "multimaster.failback", f"peer={peer_minion.id}")

    say("Every master agrees: a second sync is clean, and the rejected minion answers no "
        "master.")
    ret = plain(primary, "multimaster.sync")
    agree = ret.returncode == 0 and all(
        (cluster.file_root(m) / "motd.sls").read_text() == hotfix
        and (cluster.pki_dir(m) / "minions_rejected" / rejected.id).exists()
        for m in cluster.masters)
    deaf = {m.id: wait_until(lambda m=m: not cluster.ping(m, rejected.id, timeout=3),
                             deadline=90) for m in cluster.masters}
    for master_id, ok in deaf.items():
        print(f"    {rejected.id} answers {master_id}: {not ok}")
    print(f"    motd.sls hot-fixed and {rejected.id} rejected on every master: {agree}")
    return agree and all(deaf.values())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--keep", action="store_true", help="keep the sandbox directory")
    args = parser.parse_args()

    sandbox = pathlib.Path(tempfile.mkdtemp(prefix="mm-demo-", dir="/tmp"))
    os.chmod(sandbox, 0o755)
    say(f"Sandbox in {sandbox}: installing salt-multimaster there (pip install .)")
    # pylint: disable=import-outside-toplevel
    from tests.support.cluster import Cluster, install_extension, standalone_factories, wait_until
    from tests.support.service import MasterService

    site = install_extension(REPO, sandbox / "site")
    # salt-factories hands its environment to the daemons it starts
    os.environ["PYTHONPATH"] = str(site)

    cluster = None
    demo_ok = False
    try:
        with contextlib.ExitStack() as stack:
            factories = standalone_factories(sandbox, stack)
            repo_copy = sandbox / "salt-multimaster"
            shutil.copytree(REPO, repo_copy, ignore=shutil.ignore_patterns(
                ".venv", ".git", "__pycache__", "*.pyc", "build", "*.egg-info", "results"))
            cluster = Cluster(
                factories, "demo", peers=1, minions=3,
                share_master_keys=False, accept_on_peers=False,
                primary_overrides={"file_roots": {"base": [
                    str(sandbox / "f" / "demo-primary" / "state-tree" / "base"), str(repo_copy)]}},
            )
            primary, peer = cluster.primary, cluster.peers[0]
            peer_minion = cluster.peer_minions[0]
            dropin = pathlib.Path(primary.config_file).parent / "master.d" / "multimaster.conf"
            dropin.parent.mkdir(exist_ok=True)
            # the contract's configuration: who the peers are, and the pull
            # channel that carries a sync's bulk point-to-point
            from salt_multimaster import protocol
            dropin.write_text(f"multimaster:\n  peers: [{peer_minion.id}]\n"
                              + protocol.peer_run_snippet([peer_minion.id, "demo-peer2"]) + "\n")
            # what salt.multimaster.master writes: the salt/key reactor
            (dropin.parent / "multimaster-reactor.conf").write_text(
                "reactor:\n- salt/key:\n  - salt://salt/multimaster/reactor/key.sls\n")
            (cluster.file_root(primary) / "motd.sls").write_text(
                "motd:\n  test.succeed_without_changes\n")
            (cluster.file_root(primary, kind="pillar_roots") / "top.sls").write_text(
                "base:\n  '*': []\n")
            # no systemd in the sandbox: the peer host's minion names the command that
            # restarts its salt-master (a stand-in for rc-service/sv/supervisorctl here)
            service = stack.enter_context(MasterService([peer], sandbox / "service"))
            service.configure(peer_minion, peer)

            say(f"Starting the primary master ({primary.config['interface']}), a fresh peer "
                f"master ({peer.config['interface']}) with its own generated keypair, the "
                f"peer host's minion ({peer_minion.id}) and three more minions, each listing "
                "both masters. Minion keys are accepted on the primary only: the sync carries "
                "them to the peer.")
            cluster.start()
            for minion in cluster.all_minions:
                cluster.wait_ping(primary, minion.id)

            say("The manual baseline: every minion answers the primary ...")
            ok, ret = answers(cluster, primary)
            show(f"salt -c {primary.config_dir} 'demo-minion*' test.ping", ret)
            say("... and none answers the peer (other master key, no minion keys there):")
            ok, ret = answers(cluster, peer)
            show(f"salt -c {peer.config_dir} 'demo-minion*' test.ping", ret)
            print(f"    {len(ok)} of 3 minions answer the peer.")

            say("What the peer lacks, without changing anything:")
            plain(primary, "multimaster.status")

            say("Replicating from the primary; the peer's salt-master restarts to load the "
                "master keys, through the command its host's minion names "
                f"(multimaster.master_restart_cmd: {service.command(peer)}, the sandbox's "
                "stand-in for a service manager):")
            plain(primary, "multimaster.sync")
            wait_until(lambda: service.restarts, deadline=120)
            print(f"    the peer's salt-master restarted: {bool(service.restarts)}")
            all_answer(cluster, peer, "the peer")

            say("A second sync has nothing to do:")
            plain(primary, "multimaster.sync")

            operators_day(cluster, primary, peer, peer_minion)

            audit_and_formula(cluster, primary, peer)

            grown = add_peer_act(cluster, factories, primary)

            say("The primary goes down; the peer still reaches every minion:")
            primary.terminate()
            ok, ret = answers(cluster, peer)
            show(f"salt -c {peer.config_dir} 'demo-minion*' test.ping", ret)
            print(f"    {len(ok)} of 3 minions answer the peer with the primary stopped.")
            back = outage_act(cluster, primary, peer, peer_minion)
            demo_ok = len(ok) == 3 and grown and back
    finally:
        say("Stopping every daemon and removing the sandbox.")
        if cluster is not None:
            cluster.stop()
        time.sleep(1)
        if not args.keep:
            shutil.rmtree(sandbox, ignore_errors=True)
    print("\nDemo " + ("succeeded." if demo_ok else "FAILED."))
    return 0 if demo_ok else 1


if __name__ == "__main__":
    sys.exit(main())
