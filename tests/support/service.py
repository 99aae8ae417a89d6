"""
A stand-in for a service manager (systemd, OpenRC, runit...) of salt-factories
masters, for the sandbox's ``multimaster.master_restart_cmd``.

:class:`MasterService` writes one executable command per master,
``<dir>/restart-<master id>``: running it asks for that master's restart and
waits until it is done (exit 0), as ``rc-service salt-master restart``
would; a restart that failed, or none after 120 s, fails it (exit 1).  A thread restarts the
salt-factories daemon when asked.  :meth:`MasterService.uninstall` removes
a command: a restart command whose program is not installed.
"""

import logging
import os
import pathlib

from tests.support.rotate import Background

log = logging.getLogger(__name__)

SCRIPT = """#!/bin/sh
# restart {name} as a service manager would: ask, then wait until it is done
rm -f "{request}.failed"
: > "{request}.new" && mv -f "{request}.new" "{request}" || exit 2
i=0
while [ -e "{request}" ] && [ $i -lt 1200 ]; do sleep 0.1; i=$((i+1)); done
[ ! -e "{request}" ] && [ ! -e "{request}.failed" ]
"""


class MasterService(Background):
    """
    Restart each of ``masters`` (salt-factories daemons) when its command,
    ``command(master)``, asks; ``restarts`` lists the ids restarted, in order.
    Use it as a context manager (the thread runs inside).
    """

    def __init__(self, masters, directory):
        self.masters = list(masters)
        self.dir = pathlib.Path(directory)
        self.restarts = []
        self._busy = False
        super().__init__("service-stand-in")
        for master in self.masters:
            self.install(master)

    def command(self, master):
        """The restart command of ``master`` (an absolute path)."""
        return str(self.dir / f"restart-{master.id}")

    def _request(self, master):
        return self.dir / f"restart-{master.id}.request"

    def install(self, master):
        """Write ``master``'s restart command (executable)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        path = pathlib.Path(self.command(master))
        path.write_text(SCRIPT.format(name=master.id, request=self._request(master)))
        os.chmod(path, 0o755)

    def configure(self, minion, master):
        """
        Name ``master``'s restart command in the option
        ``multimaster.master_restart_cmd`` of its host's ``minion`` (a
        minion.d drop-in, as an operator sets it; before the minion starts).
        """
        dropin = pathlib.Path(minion.config_file).parent / "minion.d" / "multimaster-peer.conf"
        dropin.parent.mkdir(exist_ok=True)
        dropin.write_text(f"multimaster.master_restart_cmd: {self.command(master)}\n")

    def uninstall(self, master):
        """Remove ``master``'s restart command: a program that is not installed."""
        pathlib.Path(self.command(master)).unlink(missing_ok=True)

    def idle(self):
        """Whether no restart is asked for or under way."""
        return not self._busy and not any(self._request(m).exists() for m in self.masters)

    def _run(self):
        while not self._stop.is_set():
            for master in self.masters:
                request = self._request(master)
                if not request.exists():
                    continue
                log.info("service stand-in: restarting %s", master.id)
                self._busy = True
                try:
                    if master.is_running():
                        master.terminate()
                    master.start()
                    self.restarts.append(master.id)
                except Exception:  # pylint: disable=broad-except
                    log.exception("service stand-in: %s did not restart", master.id)
                    request.rename(f"{request}.failed")  # the command exits 1
                    continue
                finally:
                    self._busy = False
                request.unlink(missing_ok=True)
            self._stop.wait(0.2)
