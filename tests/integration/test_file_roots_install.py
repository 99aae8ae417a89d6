"""
The second install path: the repository as a file_roots root, nothing pip
installed.  ``saltutil.sync_all`` on the minion and ``saltutil.sync_runners``
on the master make the extension load, ``salt.multimaster`` is an SLS, and
the audit runs on the minion and on the master.
"""

import pytest

pytestmark = pytest.mark.daemons


@pytest.fixture(scope="module")
def cluster(cluster_factory, clean_environ, repo_tree):
    cluster = cluster_factory(
        "fro",
        peers=0,
        minions=1,
        environ=clean_environ,
        primary_overrides={"file_roots": {"base": [str(repo_tree)]}},
    )
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def before_sync(cluster):
    """What the minion and the master answered before any sync: asked once, first."""
    minion = cluster.minions[0].id
    return {"minion": cluster.salt(cluster.primary, "multimaster.version", minion_tgt=minion),
            "master": cluster.salt_run(cluster.primary, "multimaster.version")}


def test_not_loaded_before_sync(before_sync):
    assert "is not available" in str(before_sync["minion"].data)
    ret = before_sync["master"]
    assert ret.returncode != 0 or "is not available" in ret.stdout


@pytest.fixture(scope="module")
def synced(cluster, before_sync):  # pylint: disable=unused-argument
    """The operator's two syncs, once, after ``before_sync``: what each returned."""
    minion = cluster.minions[0].id
    return {"minion": cluster.salt(cluster.primary, "saltutil.sync_all", minion_tgt=minion,
                                   timeout=180),
            "master": cluster.salt_run(cluster.primary, "saltutil.sync_runners")}


def test_sync_all_loads_module_and_states(cluster, synced):
    minion = cluster.minions[0].id
    ret = synced["minion"]
    assert ret.returncode == 0, ret
    assert "modules.multimaster" in ret.data["modules"]
    assert "states.multimaster" in ret.data["states"]
    assert "utils.salt_multimaster" in str(ret.data["utils"])
    ret = cluster.salt(cluster.primary, "multimaster.version", minion_tgt=minion)
    assert ret.returncode == 0, ret
    assert "/extmods/modules/" in ret.data["module"]
    ret = cluster.salt(cluster.primary, "sys.doc", "multimaster", minion_tgt=minion)
    assert "CLI Example" in ret.data["multimaster.version"]


def test_sync_runners_loads_runner(cluster, synced):
    ret = synced["master"]
    assert ret.returncode == 0, ret
    assert "runners.multimaster" in ret.data
    ret = cluster.salt_run(cluster.primary, "multimaster.version")
    assert ret.returncode == 0, ret
    assert "/extmods/runners/" in ret.data["runner"]
    # Salt has no runner named sys.doc: runner docs come from doc.runner / salt-run -d
    ret = cluster.salt_run(cluster.primary, "doc.runner")
    assert "CLI Example" in ret.data["multimaster.version"], ret
    ret = cluster.salt_run(cluster.primary, "-d", "multimaster")
    assert "CLI Example" in ret.stdout, ret


def test_runner_guarded_on_its_first_load(cluster, synced):
    """
    The runner synced alone (``_utils`` not yet on the master) is guarded
    all the same: a misspelt keyword is answered in the guard's words, not
    run and not refused by Salt's.
    """
    assert synced["master"].returncode == 0, synced["master"]
    ret = cluster.salt_run(cluster.primary, "multimaster.status", "peer=x", "--out=json")
    assert ret.returncode != 0, ret
    assert ret.data["result"] is False, ret
    assert ret.data["error"].startswith(
        "multimaster.status: unknown argument peer: did you mean peers? (accepted: "), ret


@pytest.mark.usefixtures("before_sync")
def test_formula_is_an_sls(cluster):
    minion = cluster.minions[0].id
    ret = cluster.salt(cluster.primary, "state.show_sls", "salt.multimaster",
                       minion_tgt=minion)
    assert ret.returncode == 0, ret
    assert isinstance(ret.data, dict) and ret.data, ret
    assert all(sls.startswith("salt.multimaster") for sls in
               {v["__sls__"] for v in ret.data.values()}), ret.data


def test_audit_through_the_file_roots_install(cluster, synced):
    daemon = cluster.minions[0]
    assert cluster.wait_ping(cluster.primary, daemon.id)
    assert synced["minion"].returncode == 0, synced["minion"]
    ret = cluster.salt(cluster.primary, "multimaster.audit", minion_tgt=daemon.id)
    assert ret.returncode == 0, ret
    assert ret.data["result"] is True
    assert ret.data["masters"] == [cluster.primary.config["interface"]]
    assert synced["master"].returncode == 0, synced["master"]
    ret = cluster.salt_run(cluster.primary, "multimaster.audit", "--out=json")
    assert ret.returncode == 0, ret
    assert ret.data["result"] is True
    assert list(ret.data["minions"]) == [daemon.id]
