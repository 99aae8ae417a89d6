"""
The master fingerprint, from a key's text or its path: one definition for
``multimaster.status``, the minion audit, the ``multimaster.master_key``
state and the docs.

"The master fingerprint" is what ``salt-key -F master`` prints for the
master's public key on the primary, and Salt changed it in 3008:

- Salt 3006 and 3007: ``salt.utils.crypt.pem_finger(path)``, the hash of the
  key's base64 body lines (header, footer and blank lines dropped), of
  ``pki_dir/master.pub``.  This is also the form a minion's own
  ``master_finger`` option is checked against (``salt.crypt``), on every
  release, 3008 included.
- Salt 3008: ``salt.key.Key.finger`` reads the text of
  ``pki_dir/<master id>.pub`` and calls ``pem_finger(key=text)``, which in
  3008.0-3008.5 hashes the whole PEM text (header, footer and final newline
  included), so the same key prints a different fingerprint.  (3006.28 and
  3007.15 made ``pem_finger(key=...)`` strip the header too; their
  ``salt-key`` reads the file by path anyway.)

``master_finger`` gives the form the installed Salt's ``salt-key -F master``
prints; ``matches`` accepts either form, so an expected fingerprint copied
from ``salt-key -F master`` on any supported release, or from a minion's
``master_finger`` option, names the same key.

Plain functions, no Salt loader: unit-tested without daemons.
"""

import hashlib
import os
import re

import salt.utils.crypt
import salt.version

HASHES_BY_LEN = {32: "md5", 40: "sha1", 56: "sha224", 64: "sha256", 96: "sha384", 128: "sha512"}

# The first Salt release whose ``salt-key -F`` hashes the whole PEM text.
TEXT_FORM_SINCE = 3008


def normalize(finger):
    """A fingerprint as bare lower-case hex (no colons), for comparisons."""
    return re.sub(r"[^0-9a-f]", "", str(finger or "").lower())


def _colons(digest):
    return ":".join(digest[i:i + 2] for i in range(0, len(digest), 2))


def normalize_pem(text):
    """
    A PEM key's text with normalised line ends and one final newline (blank
    lines and the blanks around each line dropped): how Salt 3008 writes and
    reads a key file, and how a trusted key is compared and written.
    """
    lines = [line.strip() for line in str(text).replace("\r\n", "\n").split("\n")]
    return "\n".join(line for line in lines if line) + "\n"


def body_finger(text, sum_type="sha256"):
    """
    Salt 3006/3007 ``salt-key -F`` (and every minion's ``master_finger``
    check): the hash of the PEM body lines, as ``pem_finger(path)`` reads them.
    """
    lines = [line for line in str(text).replace("\r\n", "\n").splitlines(True) if line.strip()]
    data = "".join(lines[1:-1])
    return _colons(getattr(hashlib, sum_type or "sha256")(data.encode("utf-8")).hexdigest())


def text_finger(text, sum_type="sha256"):
    """
    Salt 3008 ``salt-key -F``: the hash of the whole PEM text (header, body,
    footer, one final newline), as Salt 3008 writes and reads the key file.
    """
    data = normalize_pem(text).encode("utf-8")
    return _colons(getattr(hashlib, sum_type or "sha256")(data).hexdigest())


def master_finger(text, sum_type="sha256"):
    """
    The fingerprint the installed Salt's ``salt-key -F master`` prints for the
    PEM public key ``text``; "" without text.  On Salt 3008 that is Salt's own
    ``pem_finger(key=text)`` (the whole PEM text on 3008.0-3008.5), before it
    ``pem_finger(path)`` (the body form).
    """
    if not text:
        return ""
    if salt.version.__version_info__[0] >= TEXT_FORM_SINCE:
        return salt.utils.crypt.pem_finger(key=normalize_pem(text).encode("utf-8"),
                                           sum_type=sum_type or "sha256")
    return body_finger(text, sum_type)


def read_key(path):
    """The text of the key file at ``path`` (symlinks followed), or None if missing."""
    if not path or not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8", errors="replace") as handle:
        return handle.read()


def file_finger(path, sum_type="sha256"):
    """``master_finger`` of the key file at ``path``, or "" if it is missing."""
    return master_finger(read_key(path), sum_type)


def matches(text, finger):
    """
    True when the PEM public key ``text`` has fingerprint ``finger`` in either
    of Salt's forms; the hash is chosen by the fingerprint's length (md5,
    sha1, sha224, sha256, sha384, sha512).
    """
    wanted, hashed_with = normalize(finger), sum_type(finger)
    if not text or not hashed_with:
        return False
    return wanted in (normalize(body_finger(text, hashed_with)),
                      normalize(text_finger(text, hashed_with)))


def sum_type(finger):
    """The hash that made ``finger``, by its length (md5 ... sha512), or None."""
    return HASHES_BY_LEN.get(len(normalize(finger)))


def valid(finger):
    """True when ``finger`` is a fingerprint of a hash Salt can produce."""
    return sum_type(finger) is not None and bool(
        re.fullmatch(r"[0-9a-fA-F:]+", str(finger or "").strip())
    )
