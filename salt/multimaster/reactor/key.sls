# -*- coding: utf-8 -*-
# vim: ft=sls
# Reactor for salt/key events on the primary master (installed by
# salt.multimaster.master): replicate minion keys to the peers.
#
# Salt 3007 fires act accept/reject/delete, Salt 3008
# accepted/rejected/pending/denied/delete.  Only a master with
# `multimaster:peers` in its config (the primary) reacts, so a peer with the
# reactor installed by mistake never syncs back, and events about the peers'
# own minions are ignored.  Bursts (salt-key -A) are coalesced by the
# multimaster_reactor.key_event runner: one sync at a time, plus one more
# when keys changed while it ran.
{%- set acts = ["accept", "reject", "delete", "accepted", "rejected", "pending", "denied"] %}
{%- set conf = opts.get("multimaster") or {} %}
{%- set peers = conf.get("peers") or [] %}
{%- if peers is string %}{% set peers = peers.split(",") %}{% endif %}
{%- if data.get("act") in acts and data.get("result", True) and peers and data.get("id") not in peers %}
multimaster-reactor-runner-multimaster_reactor-key_event:
  runner.multimaster_reactor.key_event:
    - args:
      - act: {{ data.get("act") | tojson }}
      - minion_id: {{ data.get("id") | tojson }}
{%- endif %}
