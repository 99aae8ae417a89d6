"""
A minion's master entries (salt_multimaster.masters): one grammar, strict for
the states and lenient for the audit, one duplicate grouping.  No loader.
"""

import pytest

from salt_multimaster import masters


def fake_resolver(table):
    def resolve(name):
        if name not in table:
            raise OSError("Name or service not known")
        return set(table[name])

    return resolve


@pytest.mark.parametrize(
    "entry,expected",
    [
        ("master01", ("master01", 4506)),
        ("Master01.Example.COM.", ("master01.example.com", 4506)),
        ("10.0.0.1:4506", ("10.0.0.1", 4506)),
        ("10.0.0.1:5506", ("10.0.0.1", 5506)),
        ("[::1]:4506", ("::1", 4506)),
        ("[2001:db8::1]", ("2001:db8::1", 4506)),
        ("fe80:0:0::1", ("fe80::1", 4506)),
        ("2001:0db8::1", ("2001:db8::1", 4506)),
    ],
)
def test_parse(entry, expected):
    assert masters.parse(entry) == expected
    assert masters.parse_lenient(entry) == (expected, None)


@pytest.mark.parametrize("entry,error", [
    ("", "master entry '' is not a non-empty string"),
    ("  ", "master entry '  ' is not a non-empty string"),
    (None, "master entry None is not a non-empty string"),
    (5, "master entry 5 is not a non-empty string"),
    ("host:abc", "master entry 'host:abc' has a non-numeric port"),
    ("host:0", "master entry 'host:0' has an invalid port 0"),
    ("host:99999", "master entry 'host:99999' has an invalid port 99999"),
    (":4506", "master entry ':4506' has no host"),
    ("[::1]x", "master entry '[::1]x' is not a valid [ipv6]:port"),
])
def test_one_grammar_strict_and_lenient(entry, error):
    """What the states refuse, the audit reads as an error naming the entry."""
    with pytest.raises(ValueError) as exc:
        masters.parse(entry)
    assert str(exc.value) == error
    assert masters.parse_lenient(entry) == ((str(entry).strip().lower(), 4506), error)


def test_default_port():
    assert masters.parse("m1", 4510) == ("m1", 4510)
    assert masters.parse_lenient("m1:x", 4510) == (("m1:x", 4510),
                                                   "master entry 'm1:x' has a non-numeric port")


def test_entries_and_split_list():
    assert masters.split_list("a, b,,c") == ["a", "b", "c"]
    assert masters.split_list(["a", " b "]) == ["a", "b"]
    assert masters.split_list(None) is None
    assert masters.entries("salt") == ["salt"]
    assert masters.entries(["a", ""]) == ["a"]
    assert masters.entries(None) == [] and masters.entries("") == []


def test_resolve_hosts_gives_up_on_unknown_names():
    resolved = masters.resolve_hosts(
        ["10.0.0.1", "m1", "nope"], resolver=fake_resolver({"m1": ["10.0.0.1"]})
    )
    assert resolved == {"10.0.0.1": {"10.0.0.1"}, "m1": {"10.0.0.1"}, "nope": set()}


def test_group_by_master():
    resolved = {"m1": {"10.0.0.1"}, "10.0.0.1": {"10.0.0.1"}, "m2": {"10.0.0.2"}}
    parsed = [(e, masters.parse(e)) for e in ["m1", "m2", "10.0.0.1:4506", "m1:4510", "m2"]]
    assert [[e for e, _ in grp] for grp in masters.group(parsed, resolved)] == [
        ["m1", "10.0.0.1:4506"], ["m2", "m2"], ["m1:4510"]]
    assert masters.same(("a", 1), ("a", 1)) and not masters.same(("a", 1), ("a", 2))
    assert not masters.same(("a", 1), ("b", 1), {"a": set(), "b": set()})


def test_dedup_keeps_first_spelling_and_order():
    unique, dups = masters.dedup(["m1", "m2", "M1:4506", "m1:4510", "m2", "m3", "m1."])
    assert unique == ["m1", "m2", "m1:4510", "m3"]
    assert dups == ["M1:4506", "m2", "m1."]


def test_dedup_uses_master_port_and_addresses():
    unique, dups = masters.dedup(["m1", "m1:4506"], default_port=4510)
    assert unique == ["m1", "m1:4506"] and dups == []
    resolved = {"m1": {"10.0.0.1"}, "10.0.0.1": {"10.0.0.1"}, "m2": {"10.0.0.2"}}
    unique, dups = masters.dedup(["m1", "m2", "10.0.0.1"], resolved=resolved)
    assert unique == ["m1", "m2"] and dups == ["10.0.0.1"]
    with pytest.raises(ValueError, match="'m1:0' has an invalid port"):
        masters.dedup(["m1", "m1:0"])
