"""The runner-to-peer protocol: sealed requests, versions, the pull grant."""

import json
import re
import string

import pytest

from salt_multimaster import protocol, seal
from tests.support.cluster import gen_keypair


@pytest.fixture(scope="module")
def keys():
    return {name: gen_keypair(2048) for name in ("m2", "m3")}


BASE64 = string.ascii_letters + string.digits + "+/="


def test_each_peer_opens_only_its_own_request(keys):
    pubs = {peer: pub for peer, (_, pub) in keys.items()}
    kwarg = protocol.sealed_kwarg(pubs, "multimaster_peer.apply", {"ops": {"x": [1]}})
    assert set(kwarg) == {"sealed"} and set(kwarg["sealed"]) == {"m2", "m3"}
    # nothing but routing in clear: each blob is base64 (no quote, no brace:
    # no JSON of the request can hide in it), none says what it holds
    text = json.dumps(kwarg)
    assert '"ops"' not in text and '"x"' not in text
    assert all(isinstance(blob, str) and set(blob) <= set(BASE64 + ".:")
               for blob in kwarg["sealed"].values())
    for peer, (priv, _) in keys.items():
        assert protocol.open_request(priv, peer, "multimaster_peer.apply", kwarg["sealed"]) == {
            "ops": {"x": [1]}}
    # m3's key does not open m2's blob, even handed over as its own
    with pytest.raises(protocol.ProtocolError):
        protocol.open_request(keys["m3"][0], "m3", "multimaster_peer.apply",
                              {"m3": kwarg["sealed"]["m2"]})
    # a request for one function is not another's
    with pytest.raises(protocol.ProtocolError):
        protocol.open_request(keys["m2"][0], "m2", "multimaster_peer.inventory", kwarg["sealed"])
    with pytest.raises(protocol.ProtocolError, match="no request sealed to 'm9'"):
        protocol.open_request(keys["m2"][0], "m9", "multimaster_peer.apply", kwarg["sealed"])


def test_other_protocol_version_is_named(keys):
    priv, pub = keys["m2"]
    body = json.dumps({"protocol": 0, "fun": "f", "kwargs": {}})
    blob = seal.seal(pub, body, "m2", "request/f")
    with pytest.raises(protocol.ProtocolError, match="protocol 0, this peer 1"):
        protocol.open_request(priv, "m2", "f", blob)



def test_every_reply_is_checked_for_its_version_and_kind():
    fun = "multimaster_peer.inventory"
    assert protocol.check_reply("m2", fun, {"protocol": 1, "master_id": "m2"}) == (
        {"master_id": "m2"}, None)
    # an old peer answers without a version: protocol 0
    assert protocol.check_reply("m2", fun, {"master_id": "m2"}) == (
        None, "peer runs protocol 0, primary 1: upgrade salt-multimaster on m2")
    assert protocol.check_reply("m2", fun, {"protocol": 2, "master_id": "m2"}) == (
        None, "peer runs protocol 2, primary 1: upgrade salt-multimaster on m2")
    assert protocol.check_reply("m2", fun, None)[1].startswith(
        "m2's salt-minion did not answer the inventory")
    assert protocol.check_reply("m2", fun, "'multimaster_peer.inventory' is not available.")[
        1].startswith("m2 gave no usable reply to the inventory: 'multimaster_peer.inventory'")
    refused = {"protocol": 1, "result": False, "error": "multimaster_peer.apply: bad ops"}
    assert protocol.check_reply("m2", "multimaster_peer.apply", refused) == (
        None, "multimaster_peer.apply: bad ops")
    assert protocol.reply({"backup": None}) == {"backup": None, "protocol": 1}


def test_requests_name_only_the_arguments_their_function_takes():
    assert protocol.request("multimaster_peer.restore", backup_name=None, test=True) == {
        "test": True}
    with pytest.raises(protocol.ProtocolError, match="takes no ops"):
        protocol.request("multimaster_peer.restore", ops={})
    assert protocol.request_args("f", {"test": True}, {"test": False, "x": 1}) == {
        "test": True, "x": 1}
    with pytest.raises(protocol.ProtocolError, match="unknown arguments in the request: y"):
        protocol.request_args("f", {"y": 1}, {"test": False})


@pytest.mark.parametrize("cat,op", [
    ("minion_keys", {"state": "minions_pre", "id": "web.1"}),
    ("file_roots", {"env": "base", "rel": "a/b c.sls"}),
    ("pillar_roots", {"env": "dev", "rel": "top.sls"}),
    ("master_keys", {"name": "master_sign.pem"}),
])
def test_item_names_parse_back(cat, op):
    assert protocol.parse_item(protocol.item_name(cat, op)) == (cat, op)


def test_master_config_item_is_the_dropin_and_bad_names_are_refused():
    assert protocol.item_name("master_config", {"values": {}}) == (
        "master_config/multimaster-sync.conf")
    for bad in ("minion_keys/minions", "keys/a/b", "file_roots/base", ""):
        with pytest.raises(protocol.ProtocolError):
            protocol.parse_item(bad)


def test_pull_request_and_reply_roundtrip(keys):
    text = protocol.pull_request("abc123", 2)
    assert protocol.open_pull_request(text) == ("abc123", 2)
    for bad in ("", "!!", protocol.pull_request("../x", 0), protocol.pull_request("a", -1)):
        with pytest.raises(protocol.ProtocolError):
            protocol.open_pull_request(bad)
    priv, pub = keys["m2"]
    sealed = protocol.seal_pull_reply(pub, "m2", "abc123", {"minion_keys/minions/a": b"k"}, [],
                                      ops={"minion_keys": []})
    unseal = lambda blob, purpose: seal.unseal(priv, blob, "m2", purpose)  # noqa: E731
    served = {"outputter": "no_return", "data": sealed}
    assert protocol.open_pull_reply(unseal, "abc123", served) == {
        "contents": {"minion_keys/minions/a": b"k"}, "missing": [], "ops": {"minion_keys": []}}
    with pytest.raises(protocol.ProtocolError, match="refused multimaster.pull .no pull grant"):
        protocol.open_pull_reply(unseal, "abc123", {"error": "no pull grant for m2"})
    with pytest.raises(protocol.ProtocolError):
        protocol.open_pull_reply(unseal, "other", sealed)


def test_pull_allowed_matches_like_salt():
    assert protocol.pull_allowed({"master0[2-9]": ["multimaster.pull"]}, "master02")
    assert protocol.pull_allowed({".*": ["multimaster.*"]}, "master02")
    assert not protocol.pull_allowed({".*": ["test.*"]}, "master02")
    assert not protocol.pull_allowed({"web.*": [".*"]}, "master02")
    assert not protocol.pull_allowed(None, "master02")
    assert not protocol.pull_allowed({"[bad": [".*"]}, "master02")
    conf = protocol.peer_run_config(["m.a-1", "m2"])
    assert conf == {r"m\.a\-1$": ["multimaster.pull"], "m2$": ["multimaster.pull"]}
    # the grant matches its peer only, as Salt matches it
    assert protocol.pull_allowed(conf, "m.a-1") and protocol.pull_allowed(conf, "m2")
    assert not protocol.pull_allowed(conf, "m2x") and not protocol.pull_allowed(conf, "mxa-1")
    assert all(re.match(k, "m2") is None or k == "m2$" for k in conf)


def test_refusal_shows_the_snippet_to_paste():
    import salt.utils.yaml  # pylint: disable=import-outside-toplevel

    msg = protocol.refusal("master02", 300 * 1024, 64 * 1024)
    assert msg.startswith("300 KiB to send to master02 exceeds inline_limit (64 KiB)")
    snippet = msg.split("\n", 1)[1]
    assert salt.utils.yaml.safe_load(snippet) == {"peer_run": {"master02$": ["multimaster.pull"]}}


def test_a_refusal_is_told_from_a_failure():
    assert protocol.refused({"result": False, "error": "bad", "protocol": protocol.PROTOCOL})
    assert not protocol.refused({"result": False, "error": "bad"})  # another version
    assert not protocol.refused(None)
    assert not protocol.refused("ERROR: it crashed")
    assert not protocol.refused({"backup": None, "protocol": protocol.PROTOCOL})
