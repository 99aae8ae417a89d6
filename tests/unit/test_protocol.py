"""The runner-to-peer protocol: sealed requests, versions, the pull grant."""

import json
import re

import pytest

from salt_multimaster import protocol, seal
from tests.support.cluster import gen_keypair


@pytest.fixture(scope="module")
def keys():
    return {name: gen_keypair(2048) for name in ("m2", "m3")}


def test_each_peer_opens_only_its_own_request(keys):
    pubs = {peer: pub for peer, (_, pub) in keys.items()}
    kwarg = protocol.sealed_kwarg(pubs, "multimaster_peer.apply", {"ops": {"x": [1]}})
    assert set(kwarg) == {"sealed"} and set(kwarg["sealed"]) == {"m2", "m3"}
    text = json.dumps(kwarg)
    assert "ops" not in text  # nothing but routing in clear
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
    assert protocol.reply_error({"protocol": 1}) is None
    assert protocol.reply_error({"master_id": "x"}) is None
    assert protocol.reply_error({"protocol": 2}) == (
        "peer runs protocol 2, primary 1: install the same salt-multimaster on every master")


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
