"""
Differences between the supported Salt lines (3006, 3007, 3008) that the
core handles in one place.  Plain functions, no Salt loader.
"""

# _contextvars: the C module Salt's loader context (salt.loader.context)
# uses.  Salt 3006 and 3007 install the PyPI ``contextvars`` backport,
# which can shadow the standard module inside the daemons: its
# copy_context() does not carry Salt's loader dunders (__salt__,
# __opts__) into a thread.
import _contextvars as _cv
import inspect
import os
import stat

import salt.crypt
import salt.version

#: a context variable of the same module (see above)
ContextVar = _cv.ContextVar
#: a copy of this thread's context, Salt's loader context variables included
copy_context = _cv.copy_context


def event_read_waits():
    """
    Whether a non-blocking read of the master event bus waits by itself
    when nothing came.  Salt 3008's client waits 10 ms, and reads at most
    4 KiB of an event per read; 3006's and 3007's return at once, with a
    whole event or none.
    """
    return salt.version.__saltstack_version__.major >= 3008


#: Salt's AES key rotation drop file, in the master's cachedir
DROPFILE = ".dfn"


def dropfile_names_master():
    """
    Whether Salt's AES key rotation drop file (``<cachedir>/.dfn``, written
    by ``salt.crypt.dropfile``) names the master it is for.  Salt 3007 and
    3008 write the master's id into it (``.dfn-next``, then a rename), and
    a master rotates only for a file (mode 0400) holding its own id; Salt
    3006 writes it empty, and a master rotates for any such file.
    """
    return "master_id" in inspect.signature(salt.crypt.dropfile).parameters


def dropfile(cachedir, user, master_id):
    """
    Ask the master whose cachedir is ``cachedir`` (its id ``master_id``, run
    as ``user``) to rotate its AES session key at its next maintenance
    loop, as ``salt-key -r/-d`` does: Salt's own ``salt.crypt.dropfile``.
    Return the drop file's path.
    """
    if dropfile_names_master():
        salt.crypt.dropfile(cachedir, user, master_id)
    else:
        salt.crypt.dropfile(cachedir, user)
    return os.path.join(cachedir, DROPFILE)


def dropfile_ignored(cachedir, master_id):
    """
    Why the master (id ``master_id``) would not rotate for the drop file now
    in ``cachedir``, or None when it will (or already did: no file left).
    Salt's maintenance loop (``salt.master.Maintenance.handle_key_rotate``)
    rotates for a regular file of mode 0400, holding the master's id where
    :func:`dropfile_names_master`.
    """
    path = os.path.join(cachedir, DROPFILE)
    try:
        st = os.stat(path)
        if st.st_mode != stat.S_IFREG | stat.S_IRUSR:
            return f"{path} has mode {stat.filemode(st.st_mode)}, not -r--------"
        if not dropfile_names_master():
            return None
        with open(path, encoding="utf-8", errors="replace") as fh:
            held = fh.read()
    except FileNotFoundError:
        return None  # taken by the master's maintenance loop
    except OSError as exc:
        return f"{path} cannot be read: {exc}"
    if held != master_id:
        return f"{path} names {held!r}, not this master ({master_id!r})"
    return None
