"""salt_multimaster.validate: strict input, each error naming the input."""

import pytest

from salt_multimaster import validate
from salt_multimaster.validate import InvalidInput

SHA = "a" * 64


@pytest.mark.parametrize("value,expected", [
    (None, False), (True, True), (False, False), (1, True), (0, False),
    ("True", True), ("false", False), ("YES", True), ("no", False), ("1", True), ("0", False),
    (" on ", True), ("off", False),
])
def test_boolean(value, expected):
    assert validate.boolean("force", value) is expected


@pytest.mark.parametrize("value", ["maybe", "", 2, -1, 0.5, [], {}, "truee"])
def test_boolean_refused(value):
    with pytest.raises(InvalidInput, match=r"^force must be a boolean .*not " + repr(value).replace("[", r"\[").replace("]", r"\]") + "$"):
        validate.boolean("force", value)


@pytest.mark.parametrize("value,expected", [
    (None, []), ("", []), ("a, b,,c", ["a", "b", "c"]), (["a", 2], ["a", "2"]),
    (("a",), ["a"]), ({"a"}, ["a"]), (7, ["7"]),
])
def test_as_list(value, expected):
    assert validate.as_list("peers", value) == expected


@pytest.mark.parametrize("value", [{"a": 1}, True, object])
def test_as_list_refused(value):
    with pytest.raises(InvalidInput) as exc:
        validate.as_list("peers", value)
    assert str(exc.value) == f"peers must be a list or a comma separated string, not {value!r}"


def test_boolean_default():
    assert validate.boolean("restart", None, default=True) is True


@pytest.mark.parametrize("value,expected", [(1, 1.0), ("30", 30.0), (0.5, 0.5), (86400, 86400.0)])
def test_timeout(value, expected):
    assert validate.timeout("timeout", value) == expected


@pytest.mark.parametrize("value,message", [
    (0, "timeout must be more than 0 seconds, not 0"),
    (-5, "timeout must be more than 0 seconds, not -5"),
    ("nan", "timeout must be a finite number of seconds, not 'nan'"),
    (float("inf"), "timeout must be a finite number of seconds, not inf"),
    ("-inf", "timeout must be a finite number of seconds, not '-inf'"),
    (86401, "timeout must be at most 86400 seconds, not 86401"),
    (10 ** 400, f"timeout must be a number of seconds, not {10 ** 400!r}"),
    ("soon", "timeout must be a number of seconds, not 'soon'"),
    (True, "timeout must be a number of seconds, not True"),
    (None, "timeout must be a number of seconds, not None"),
    ([1], "timeout must be a number of seconds, not [1]"),
])
def test_timeout_refused(value, message):
    with pytest.raises(InvalidInput) as exc:
        validate.timeout("timeout", value)
    assert str(exc.value) == message


def test_delay():
    assert validate.delay("restart_delay", "5") == 5
    assert validate.delay("restart_delay", 0) == 0
    for bad in (-1, 1.5, "abc", float("nan"), 3601, True):
        with pytest.raises(InvalidInput, match="^restart_delay must be"):
            validate.delay("restart_delay", bad)


def test_known_kwargs():
    validate.known_kwargs({"rescan": True, "__pub_user": "root", "__kwarg__": True},
                          ("rescan",))
    with pytest.raises(InvalidInput) as exc:
        validate.known_kwargs({"tset": True, "rescan": 1, "zz": 2}, ("rescan", "timeout", "test"))
    assert str(exc.value) == ("unknown arguments tset (did you mean test?), "
                              "zz (accepted: rescan, test, timeout)")
    with pytest.raises(InvalidInput) as exc:
        validate.known_kwargs({"peer": "m2"}, ("peers", "only", "test"))
    assert str(exc.value) == ("unknown argument peer: did you mean peers? "
                              "(accepted: only, peers, test)")
    with pytest.raises(InvalidInput) as exc:
        validate.known_kwargs({"zz": 1}, ("peers",))
    assert str(exc.value) == "unknown argument zz (accepted: peers)"


def test_conf_mapping():
    assert validate.conf_mapping(None) == {}
    assert validate.conf_mapping({"peers": ["m2"]}) == {"peers": ["m2"]}
    for bad in ("m2", ["m2"], 3):
        with pytest.raises(InvalidInput, match="^the master config option multimaster must be a mapping"):
            validate.conf_mapping(bad)


def test_peers():
    assert validate.peers(["m2"], ["m2", "m3"]) == ["m2"]
    with pytest.raises(InvalidInput) as exc:
        validate.peers(["m2", "web01"], ["m2", "m3"])
    assert str(exc.value).startswith("peer(s) 'web01' not in multimaster:peers of the master "
                                     "config (configured: m2, m3)")
    with pytest.raises(InvalidInput, match=r"configured: none"):
        validate.peers(["m2"], [])


def test_config_keys():
    assert validate.config_keys(["nodegroups", "external_auth", "publisher_acl_blacklist",
                                 "peer", "peer_run"])
    for bad in ("pki_dir", "interface", "id", "cachedir", "multimaster", "file_roots"):
        with pytest.raises(InvalidInput) as exc:
            validate.config_keys(["nodegroups", bad])
        assert str(exc.value).startswith(f"master_config_keys: {bad!r} not replicable")


def test_shared_config_keys_are_salt_master_options():
    import salt.config  # pylint: disable=import-outside-toplevel

    known = set(salt.config.DEFAULT_MASTER_OPTS) | {"peer_run"}
    assert set(validate.SHARED_CONFIG_KEYS) <= known


def test_categories():
    assert validate.categories(["minion_keys"]) == ["minion_keys"]
    with pytest.raises(InvalidInput, match="^categories must be a list of categories, not 'minion_keys'$"):
        validate.categories("minion_keys")
    with pytest.raises(InvalidInput, match="^categories: unknown category 'keys'"):
        validate.categories(["keys"])


@pytest.mark.parametrize("mid,ok", [
    ("web01", True), ("web-01.example.com", True), ("x\n*", False), ("*", False),
    ("web?", False), ("a b", False), ("a/b", False), ("", False), ("..", False), (None, False),
    ("[ab]", False), ("a,b", False), ("a\tb", False),
])
def test_event_minion_id(mid, ok):
    assert validate.event_minion_id(mid) is ok


GOOD_OPS = {
    "minion_keys": [{"op": "write", "state": "minions", "id": "web1", "sha256": SHA, "data": "k"},
                    {"op": "remove", "state": "minions_pre", "id": "web2"}],
    "file_roots": [{"op": "write", "env": "base", "rel": "a/top.sls", "mode": 0o644,
                    "sha256": SHA, "size": 3},
                   {"op": "remove", "env": "base", "rel": "old.sls"}],
    "pillar_roots": [{"op": "write", "env": "base", "rel": "p.sls", "mode": 0o600,
                      "sha256": SHA, "sealed": "mmseal1:..."}],
    "master_keys": [{"op": "write", "kind": "pem", "name": "master.pem", "sha256": SHA,
                     "sealed": "mmseal1:..."},
                    {"op": "write", "kind": "pub", "name": "master.pub", "sha256": SHA,
                     "data": "-----BEGIN"}],
    "master_config": [{"op": "write", "values": {"nodegroups": {}}}],
}


def test_ops_accepts_what_the_runner_plans():
    assert validate.ops(GOOD_OPS) is GOOD_OPS
    assert validate.ops(None) == {}
    assert validate.ops({}) == {}


@pytest.mark.parametrize("ops,message", [
    ("x", "ops must be a mapping of category to operations, not 'x'"),
    (["minion_keys"], "ops must be a mapping of category to operations, not ['minion_keys']"),
    ({"keys": []}, "ops: unknown category 'keys' (known: master_keys, minion_keys, file_roots, "
                   "pillar_roots, master_config)"),
    ({"minion_keys": "minions/web1"}, "ops['minion_keys'] must be a list of operations, not "
                                      "'minions/web1'"),
    ({"minion_keys": ["web1"]}, "ops['minion_keys'][0] must be a mapping, not 'web1'"),
    ({"minion_keys": [{"state": "minions", "id": "w"}]}, "ops['minion_keys'][0]: missing field 'op'"),
    ({"minion_keys": [{"op": "chmod", "state": "minions", "id": "w"}]},
     "ops['minion_keys'][0]: invalid op 'chmod'"),
    ({"minion_keys": [{"op": "write", "state": "minions", "id": "w"}]},
     "ops['minion_keys'][0]: missing field 'sha256'"),
    ({"minion_keys": [{"op": "remove", "state": "minions", "id": "../x"}]},
     "ops['minion_keys'][0]: invalid id '../x'"),
    ({"minion_keys": [{"op": "remove", "state": "elsewhere", "id": "w"}]},
     "ops['minion_keys'][0]: invalid state 'elsewhere'"),
    ({"file_roots": [{"op": "write", "env": "base", "rel": "../x", "mode": 420, "sha256": SHA}]},
     "ops['file_roots'][0]: invalid rel '../x'"),
    ({"file_roots": [{"op": "write", "env": "base", "rel": "x", "mode": "0644", "sha256": SHA}]},
     "ops['file_roots'][0]: field 'mode' must be an int, not '0644'"),
    ({"file_roots": [{"op": "write", "env": "base", "rel": "x", "mode": 420, "sha256": "zz"}]},
     "ops['file_roots'][0]: invalid sha256 'zz'"),
    ({"pillar_roots": [{"op": "remove", "rel": "x"}]}, "ops['pillar_roots'][0]: missing field 'env'"),
    ({"master_keys": [{"op": "write", "kind": "pem", "name": "master.pem", "sha256": SHA}]},
     "ops['master_keys'][0]: missing field 'sealed'"),
    ({"master_keys": [{"op": "remove", "kind": "pem"}]},
     "ops['master_keys'][0]: master keys are only written"),
    ({"master_config": [{"op": "write", "values": ["pki_dir"]}]},
     "ops['master_config'][0]: field 'values' must be a dict, not ['pki_dir']"),
])
def test_ops_refused(ops, message):
    with pytest.raises(InvalidInput) as exc:
        validate.ops(ops)
    assert str(exc.value) == message


def test_ops_master_config_values_allow_list():
    with pytest.raises(InvalidInput, match="^master_config_keys: 'pki_dir' not replicable"):
        validate.ops({"master_config": [{"op": "write", "values": {"pki_dir": "/tmp/x"}}]})


