"""
Entry point for Salt's loader (group ``salt.loader``).

``loader_dirs`` returns the directories holding this extension's runners,
execution modules, states, outputter and engine.  In an installed wheel they are copied
beside this file (``runners/``, ``modules/``, ``states/``, ``output/``, ``engines/``); in a
source tree or an editable install they are the repository's ``_runners``, ``_modules``,
``_states``, ``_output`` and ``_engines``.
"""

import os

_KINDS = {"runners": "_runners", "modules": "_modules", "states": "_states",
          "output": "_output", "engines": "_engines"}


def loader_dirs():
    """
    Return ``{"runners": [...], "modules": [...], "states": [...], "output": [...],
    "engines": [...]}`` for Salt.
    """
    here = os.path.dirname(os.path.abspath(__file__))
    repo_root = os.path.dirname(os.path.dirname(here))
    ret = {}
    for kind, repo_dir in _KINDS.items():
        for candidate in (os.path.join(here, kind), os.path.join(repo_root, repo_dir)):
            if os.path.isdir(candidate):
                ret[kind] = [candidate]
                break
    return ret
