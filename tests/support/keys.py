"""Helpers for tests of the minion keys manifests."""

from salt_multimaster import manifest


def digest_of_keys(man):
    """The bucket digests of a keys manifest (``{state: {id: sha256}}``), as both sides compute them."""
    return manifest.bucket_digests(manifest.split("minion_keys", man))
