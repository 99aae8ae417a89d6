"""
Shared core of salt-multimaster.

Plain functions used by the ``multimaster`` runner, execution modules and
states.  The package is importable in both ways Salt users install the
extension:

* ``pip install salt-multimaster`` installs it as ``salt_multimaster`` into
  site-packages;
* with the repository as a ``file_roots`` entry, ``saltutil.sync_all`` (minions)
  and ``saltutil.sync_utils`` (masters) copy ``_utils/salt_multimaster`` into
  ``<cachedir>/extmods/utils``, a directory Salt puts on ``sys.path`` while it
  loads custom modules.

Nothing here imports at package level: Salt's utils loader also loads this
``__init__`` as a utils module.
"""

__version__ = "0.1.0"
