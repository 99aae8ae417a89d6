"""
salt_multimaster.publish.PublishClient: the installed Salt's LocalClient,
less the module loaders a publish does not use, built on first use.
"""

import os

import salt.client
import salt.config
import salt.loader
import salt.utils.user

from salt_multimaster import publish


def _opts(tmp_path):
    """A master's options under ``tmp_path``, with the key file a running master writes."""
    (tmp_path / "master").write_text(f"root_dir: {tmp_path}\n")
    opts = salt.config.master_config(str(tmp_path / "master"))
    for key in ("cachedir", "sock_dir", "pki_dir"):
        os.makedirs(opts[key], exist_ok=True)
    user = salt.utils.user.get_specific_user()
    with open(os.path.join(opts["cachedir"], f".{user}_key"), "w", encoding="utf-8") as fh:
        fh.write("the-master-key")
    return opts


def test_same_attributes_as_salts_localclient_less_the_loaders(tmp_path):
    """
    Made from the same options, PublishClient sets what the installed
    Salt's LocalClient sets, to the same values, but the three loaders:
    a Salt release that sets something more in LocalClient.__init__ fails
    this test instead of a publish.
    """
    opts = _opts(tmp_path)
    salts = salt.client.LocalClient(mopts=opts)
    ours = publish.PublishClient(opts)
    try:
        assert set(vars(salts)) - set(vars(ours)) == set(publish.LAZY)
        assert set(vars(ours)) - set(vars(salts)) == {"published"}
        same = {name: getattr(ours, name) == getattr(salts, name)
                for name in vars(salts) if name not in ("event", *publish.LAZY)}
        assert same == {name: True for name in same}
        assert ours.key == "the-master-key"
        assert type(ours.event) is type(salts.event)  # pylint: disable=unidiomatic-typecheck
        assert ours.event.opts == salts.event.opts
        def plain(event):
            return {k: v for k, v in vars(event).items()
                    if isinstance(v, (str, int, float, bool, type(None)))}

        assert plain(ours.event) == plain(salts.event)
    finally:
        salts.destroy()
        ours.destroy()


def test_loaders_built_on_first_use_and_not_to_be_destroyed(tmp_path, monkeypatch):
    opts = _opts(tmp_path)
    built = []
    for name in ("utils", "minion_mods", "returners"):
        real = getattr(salt.loader, name)
        monkeypatch.setattr(salt.loader, name,
                            lambda *a, _real=real, _name=name, **kw: built.append(_name)
                            or _real(*a, **kw))
    client = publish.PublishClient(opts)
    assert built == []
    assert not set(publish.LAZY) & set(vars(client))
    # a job-cache reader of Salt's reads the returners: they, and what they
    # need, are built then, once
    returners = client.returners
    assert built == ["utils", "minion_mods", "returners"]
    assert client.returners is returners
    assert f"{opts['master_job_cache']}.get_load" in returners
    assert built == ["utils", "minion_mods", "returners"]
    client.destroy()
    assert client.event is None

    other = publish.PublishClient(opts)
    other.destroy()
    assert built == ["utils", "minion_mods", "returners"]  # none built by destroy
    assert (other.utils, other.functions, other.returners) == (None, None, None)


def test_a_job_it_published_exists_without_the_job_cache(tmp_path, monkeypatch):
    """
    get_iter_returns asks returns_for_job whether the job exists: for a jid
    this client published, yes, with no loader built; any other jid is
    asked of the master's job cache, as Salt does.
    """
    opts = _opts(tmp_path)
    client = publish.PublishClient(opts)
    monkeypatch.setattr(salt.client.LocalClient, "pub",
                        lambda self, *a, **kw: {"jid": "20261127120000000001", "minions": ["p1"]})
    try:
        assert client.pub("p1", "test.ping", tgt_type="list") == {
            "jid": "20261127120000000001", "minions": ["p1"]}
        assert client.returns_for_job("20261127120000000001") is True
        assert not set(publish.LAZY) & set(vars(client))
        # a jid of someone else's: the job cache (local_cache) knows nothing of it
        assert not client.returns_for_job("20261127120000000002")
        assert set(publish.LAZY) <= set(vars(client))
    finally:
        client.destroy()
