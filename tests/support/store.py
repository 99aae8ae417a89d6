"""Damage to the state store (``cachedir/multimaster/state.sqlite``), for the scanners' tests."""

import gc
import os
import sqlite3

from salt_multimaster import store

DAMAGES = ("garbage", "schema", "directory", "dropped-table")


def damage(state_dir, how, table="keys"):
    """Damage the store of ``state_dir`` as ``how`` says (``table``: the one dropped)."""
    path = state_dir / store.NAME
    gc.collect()  # the scans' connections closed: nothing left in a WAL
    if how == "garbage":
        path.write_bytes(os.urandom(4096))
    elif how == "schema":
        with sqlite3.connect(path) as db:
            db.execute("PRAGMA user_version=7")
    elif how == "directory":
        path.unlink()
        path.mkdir()
    else:
        with sqlite3.connect(path) as db:
            db.execute(f"DROP TABLE {table}")
