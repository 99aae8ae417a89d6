"""Planning a peer from the primary's previous state: the same plan as from the peer's details."""

from salt_multimaster import manifest, sync
from tests.support.keys import digest_of_keys

A, B, C = "a" * 64, "b" * 64, "c" * 64


def _primary(cat, before, now, previous=True):
    parts = manifest.split(cat, now)
    entry = {"digest": manifest.bucket_digests(parts),
             "previous": ((digest_of_keys(before) if cat == "minion_keys"
                           else manifest.bucket_digests(manifest.split(cat, before)),
                           lambda: manifest.split(cat, before)) if previous else None)}
    entry["parts"] = parts
    if cat != "minion_keys":
        entry["envs"] = sorted(now)
    return {cat: entry}


def _inventory(cat, peer, sent, history=()):
    """What multimaster_peer.inventory answers, compared with the digests ``sent``."""
    parts = manifest.split(cat, peer)
    mine = manifest.bucket_digests(parts)
    diff = manifest.differing(sent, mine)
    inv = {"digest": mine, "buckets": diff, "manifest": manifest.merge(parts, diff), "errors": []}
    if cat == "minion_keys":
        inv["history"] = [mid for mid in history if manifest.bucket_of(mid) in set(diff)]
    else:
        inv["envs"] = sorted(peer)
    return {cat: inv}


def _both_ways(cat, before, now, history=()):
    """The plan for a peer holding ``before``, asked with the previous and the current digests."""
    primary = _primary(cat, before, now)
    old_sent, new_sent = primary[cat]["previous"][0], primary[cat]["digest"]
    from_previous = sync.plan("shared", [cat], primary, _inventory(cat, before, old_sent, history), False)
    from_details = sync.plan("shared", [cat], primary, _inventory(cat, before, new_sent, history), False)
    assert not sync.unplannable([cat], primary, _inventory(cat, before, old_sent), {cat: old_sent})
    return from_previous, from_details


def test_keys_planned_from_the_previous_state_as_from_the_peer():
    before = {"minions": {"web1": A, "gone": B}, "minions_pre": {"new": C}}
    now = {"minions": {"web1": A, "new": C}, "minions_pre": {}}
    from_previous, from_details = _both_ways("minion_keys", before, now, history=["web1", "gone", "new"])
    assert from_previous == from_details
    assert from_previous[1]["minion_keys"] == {
        "added": ["minions/new"], "updated": [], "removed": ["minions/gone", "minions_pre/new"],
        "conflicts": [], "errors": []}


def test_files_planned_from_the_previous_state_as_from_the_peer():
    before = {"base": {"a.sls": [1, 0o644, A], "old.sls": [1, 0o644, B]}}
    now = {"base": {"a.sls": [1, 0o644, C], "new.sls": [1, 0o600, B]}}
    from_previous, from_details = _both_ways("file_roots", before, now)
    assert from_previous == from_details
    assert from_previous[1]["file_roots"] == {
        "added": ["base:new.sls"], "updated": ["base:a.sls"], "removed": ["base:old.sls"],
        "conflicts": [], "errors": []}


def test_a_peer_not_in_the_previous_state_is_planned_from_its_details():
    before = {"base": {"a.sls": [1, 0o644, A]}}
    now = {"base": {"a.sls": [1, 0o644, C]}}
    peer = {"base": {"a.sls": [1, 0o644, B], "local.sls": [1, 0o644, B]}}
    primary = _primary("file_roots", before, now)
    inv = _inventory("file_roots", peer, primary["file_roots"]["previous"][0])
    _, report = sync.plan("shared", ["file_roots"], primary, inv, False)
    assert report["file_roots"]["updated"] == ["base:a.sls"]
    assert report["file_roots"]["removed"] == ["base:local.sls"]


def test_without_the_previous_state_the_peer_is_asked_again():
    before = {"minions": {"web1": A}}
    now = {"minions": {"web1": A, "web2": B}}
    sent = digest_of_keys(before)
    inv = _inventory("minion_keys", before, sent)
    lost = _primary("minion_keys", before, now, previous=False)
    assert sync.unplannable(["minion_keys"], lost, inv, {"minion_keys": sent})
    # a previous state that is not the one whose digests were sent
    other = _primary("minion_keys", {"minions": {"web1": A, "web2": C}}, now)
    assert sync.unplannable(["minion_keys"], other, inv, {"minion_keys": sent})
    # in step with the current state: nothing to ask
    current = _primary("minion_keys", now, now, previous=False)
    inv_now = _inventory("minion_keys", now, current["minion_keys"]["digest"])
    assert not sync.unplannable(["minion_keys"], current, inv_now,
                                {"minion_keys": current["minion_keys"]["digest"]})


def test_a_previous_state_that_does_not_match_its_digests_is_not_trusted():
    before = {"minions": {"web1": A, "gone": B}}
    now = {"minions": {"web1": A}}
    primary = _primary("minion_keys", before, now)
    sent = primary["minion_keys"]["previous"][0]
    inv = _inventory("minion_keys", before, sent)
    assert not sync.unplannable(["minion_keys"], primary, inv, {"minion_keys": sent})
    primary["minion_keys"]["previous"] = (sent, lambda: {})  # lost its content
    assert sync.unplannable(["minion_keys"], primary, inv, {"minion_keys": sent})


# ----- the periodic full verify (multimaster:verify_interval) -----------------
def test_a_full_verify_is_due_once_per_interval(tmp_path):
    opts = {"cachedir": str(tmp_path)}
    assert sync.verify_due(opts, 3600) is True  # never verified
    sync.verified(opts)
    marker = tmp_path / "multimaster" / sync.VERIFY_NAME
    assert oct(marker.stat().st_mode & 0o777) == "0o600"
    assert sync.verify_due(opts, 3600) is False
    assert sync.verify_due(opts, 3600, now=marker.stat().st_mtime + 3600) is True
    assert sync.verify_due(opts, 3600, now=marker.stat().st_mtime - 60) is True  # clock went back
    assert sync.verify_due(opts, 0) is False  # 0: never


def test_a_damaged_verify_record_makes_the_verify_due_and_is_made_again(tmp_path):
    opts = {"cachedir": str(tmp_path)}
    marker = tmp_path / "multimaster" / sync.VERIFY_NAME
    marker.mkdir(parents=True)
    assert sync.verify_due(opts, 3600) is True
    sync.verified(opts)
    assert marker.is_file() and sync.verify_due(opts, 3600) is False
