# -*- coding: utf-8 -*-
# vim: ft=sls
# salt.multimaster: a minion's multi-master configuration.
# Apply salt.multimaster.master on the primary master.
include:
  - .minion
