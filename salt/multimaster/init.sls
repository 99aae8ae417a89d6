# -*- coding: utf-8 -*-
# vim: ft=sls
# salt.multimaster: a minion's multi-master configuration and trusted master key.
# Apply salt.multimaster.master to the primary master's own minion for the
# automatic sync (reactor on salt/key).
include:
  - .minion
