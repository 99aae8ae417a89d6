"""
One line per progress event of a long ``salt-run multimaster.sync``.

The ``multimaster`` runner fires its progress events with this outputter when
``salt-run`` prints its compact report (no ``--out``); ``salt-run`` hands each
event to it as ``{"suffix": "progress", "event": {...}}``.  With ``--out=json``
or ``--out=yaml`` no progress is printed and the output is the data alone.

CLI Example:

.. code-block:: bash

    salt-run multimaster.sync
"""

__virtualname__ = "multimaster_progress"


def __virtual__():
    return __virtualname__


def output(data, **kwargs):  # pylint: disable=unused-argument
    """
    Return the event's ``message`` (one line), or the data as text when it
    carries none.
    """
    event = data.get("event", data) if isinstance(data, dict) else data
    if isinstance(event, dict) and isinstance(event.get("message"), str):
        return event["message"]
    return str(data)
