"""
Make a minion's multi-master configuration consistent and make it trust the
expected master key.
"""

import logging

log = logging.getLogger(__name__)

__virtualname__ = "multimaster"

try:
    import salt_multimaster  # noqa: F401  pylint: disable=unused-import

    HAS_CORE = True
except ImportError:
    HAS_CORE = False


def __virtual__():
    if HAS_CORE:
        return __virtualname__
    return (
        False,
        "multimaster: the salt_multimaster core is missing; pip install "
        "salt-multimaster, or run 'saltutil.sync_all' with the repository in file_roots",
    )
