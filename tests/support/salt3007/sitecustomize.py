"""
Tests only, Salt 3007 salt-minion daemons only (``Cluster._minion`` puts this
directory first on their ``PYTHONPATH``): the check Salt 3008.3 added to
``salt.transport.zeromq.RequestClient.connect``, a closed client refuses to
connect again.

Salt 3007 lacks it (3007.15; 3007.17's ``RequestClient`` is the same).  A
coroutine that captured a master's ``req_channel`` (a job return from a job
process, a ``_fire_master`` event) and sends on it after the minion closed
that channel (``__master_disconnected``, from the ``master_alive_interval``
check when that master stops) makes the closed client connect again: a new
zmq Context and socket nobody closes.  When the client is collected, pyzmq's
``Context.__del__`` can block in ``term()``, and with it the minion's main
loop, for good (py-spy: ``Context.term`` from ``Context.__del__`` in a
tornado callback; the allocation, traced: ``RequestClient.send`` ->
``connect`` -> ``_init_socket``).  Salt 3008.3's ``connect`` carries the
same analysis and the same refusal (``SaltClientError``); the caller's retry
or timeout then takes its usual path.  docs/install.rst tells operators.

Nothing is changed where the check is already there (a 3007 release with
the fix), or on another Salt line.
"""

import inspect


def _backport():
    import salt.version

    if salt.version.__saltstack_version__.major != 3007:
        return False
    import salt.transport.zeromq as zeromq
    from salt.exceptions import SaltClientError

    original = zeromq.RequestClient.connect
    if "RequestClient is closed" in inspect.getsource(original):
        return False

    async def connect(self):
        if self._closing:
            raise SaltClientError("RequestClient is closed; construct a new one to reconnect.")
        await original(self)

    connect.__doc__ = original.__doc__
    zeromq.RequestClient.connect = connect
    return True


BACKPORTED = _backport()
