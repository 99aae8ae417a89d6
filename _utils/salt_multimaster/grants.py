"""
Pull grants left behind: a sync writes ``cachedir/multimaster/pull/<token>``
(the grant, with its expiry) and its pulls append their jids to
``<token>.jids``; the sync revokes both when the peer has applied.  A sync
killed before that leaves them, and the sealed chunks the jids name in the
job cache, for ever: the next sync finds them here and revokes them.
"""

import os
import time

from salt_multimaster import statefile

JIDS_SUFFIX = ".jids"


def expired(pull_dir, now=None, ttl=600):
    """
    The tokens of ``pull_dir`` whose grant has expired: its ``expires`` is
    past, or the grant is unreadable, or missing beside its ``.jids`` file,
    and untouched for ``ttl`` seconds (a grant being written is not taken).
    """
    now = time.time() if now is None else now
    try:
        names = os.listdir(pull_dir)
    except OSError:  # none yet, or damaged: the next grant moves it aside
        return []
    tokens = set()
    for name in names:
        token = name[: -len(JIDS_SUFFIX)] if name.endswith(JIDS_SUFFIX) else name
        if token.isalnum():
            tokens.add(token)
    ret = []
    for token in sorted(tokens):
        path = os.path.join(pull_dir, token)
        try:
            expires = float(statefile.read(path)["expires"])
        except (statefile.Damaged, ValueError, KeyError, TypeError):
            expires = None
        if expires is not None:
            if expires < now:
                ret.append(token)
            continue
        # no readable grant: judge by the age of what is there
        ages = []
        for candidate in (path, path + JIDS_SUFFIX):
            try:
                ages.append(now - os.stat(candidate).st_mtime)
            except OSError:
                pass
        if ages and min(ages) > ttl:
            ret.append(token)
    return ret


def jids(pull_dir, token):
    """The jids the pulls of grant ``token`` recorded."""
    try:
        with open(os.path.join(pull_dir, token + JIDS_SUFFIX), encoding="utf-8",
                  errors="replace") as fh:
            return [line.strip() for line in fh if line.strip().isdigit()]
    except OSError:
        return []
