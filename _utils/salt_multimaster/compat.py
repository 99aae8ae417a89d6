"""
Differences between the supported Salt lines (3006, 3007, 3008) that the
core handles in one place.  Plain functions, no Salt loader.
"""

import salt.version

try:
    # The C module Salt's loader context (salt.loader.context) uses.  Salt
    # 3006 and 3007 install the PyPI ``contextvars`` backport, which can
    # shadow the standard module inside the daemons: its copy_context() does
    # not carry Salt's loader dunders (__salt__, __opts__) into a thread.
    import _contextvars as _cv
except ImportError:  # pragma: no cover
    import contextvars as _cv


def copy_context():
    """A copy of this thread's context, Salt's loader context variables included."""
    return _cv.copy_context()


def event_read_waits():
    """
    Whether a non-blocking read of the master event bus waits by itself
    when nothing came.  Salt 3008's client waits 10 ms, and reads at most
    4 KiB of an event per read; 3006's and 3007's return at once, with a
    whole event or none.
    """
    return salt.version.__saltstack_version__.major >= 3008
