"""A peer's key history as its state store holds it, for the tests."""

from salt_multimaster import store


def received(state_dir):
    """
    The ids the peer of ``state_dir`` received from the primary (a sorted
    list): the ``history`` table, read as :func:`salt_multimaster.history.history_of`
    reads it (none: no store, or an unreadable one).
    """
    return sorted(mid for (mid,) in store.select(state_dir, "SELECT id FROM history"))
