"""
The ``LocalClient`` the runners publish through.

Salt's ``LocalClient`` builds three module loaders as it is made (utils,
execution modules, returners), and each lists its module directories: 20
to 40 ms a client, before every publish of a sync (``bench/README.rst``).
Publishing (``run_job``, ``cmd``) uses none of them; reading the returns
off the master event bus (``get_iter_returns``) uses the returners only to
ask the job cache whether the job exists, which a client that published it
knows.  :class:`PublishClient` answers that for its own publishes and builds
each loader on first use (Salt's job-cache readers, ``get_cache_returns``,
``get_full_returns`` ..., still use them).
"""

import salt.client
import salt.loader
import salt.utils.event
import salt.utils.user

#: the attributes of a LocalClient that PublishClient builds on first use
LAZY = ("utils", "functions", "returners")


class PublishClient(salt.client.LocalClient):
    """
    A ``LocalClient`` of the master whose options are ``mopts``, made as
    Salt 3006 to 3008 make one from ``mopts`` (the other arguments at
    their defaults), less the loaders of :data:`LAZY`: each is built when
    first read.  ``published``: the jids of its own publishes.
    ``tests/unit/test_publish.py`` holds it to the installed Salt's
    ``LocalClient``, attribute for attribute.
    """

    def __init__(self, mopts):  # pylint: disable=super-init-not-called
        self.opts = mopts
        self.salt_user = salt.utils.user.get_specific_user()
        self.skip_perm_errors = False
        self.key = self._LocalClient__read_master_key()
        self.auto_reconnect = False
        self.listen = False
        self.event = salt.utils.event.get_event("master", self.opts["sock_dir"], opts=self.opts,
                                                listen=False, io_loop=None, keep_loop=False)
        self.published = set()

    def __getattr__(self, name):
        # called only for an attribute not set: a loader not built yet
        if name == "utils":
            value = salt.loader.utils(self.opts)
        elif name == "functions":
            value = salt.loader.minion_mods(self.opts, utils=self.utils)
        elif name == "returners":
            value = salt.loader.returners(self.opts, self.functions)
        else:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        setattr(self, name, value)
        return value

    def pub(self, *args, **kwargs):  # pylint: disable=arguments-differ
        ret = super().pub(*args, **kwargs)
        if isinstance(ret, dict) and ret.get("jid"):
            self.published.add(str(ret["jid"]))
        return ret

    def returns_for_job(self, jid):
        # Salt's get_iter_returns asks the job cache whether the job exists
        # before reading its returns: one this client published does
        if str(jid) in self.published:
            return True
        return super().returns_for_job(jid)

    def destroy(self):
        # a loader never built is not built now to be destroyed (nor an
        # event connection by a client whose __init__ failed)
        for name in ("event", *LAZY):
            vars(self).setdefault(name, None)
        super().destroy()
