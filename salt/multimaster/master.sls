# -*- coding: utf-8 -*-
# vim: ft=sls
# On the primary master's host (apply to its own minion): a master.d drop-in
# with a reactor on salt/key that replicates minion keys to the peers, the
# peer_run grant that lets each configured peer pull a sync's bulk, and an
# optional schedule for a periodic full `multimaster.sync`.  The master
# restarts in the background (after the state run returned) when it changed;
# where it cannot restart (no service manager) the state fails and says so.
# With pillar multimaster:master:watch: True the drop-in also runs the
# multimaster_watch engine (the change journal a sync reads instead of every
# directory, docs/watch.rst).  A peer master's host applies this same state
# to its own minion to run the engine there (pillar `watch: True` with
# `reactor: False`: the reactor and the schedule belong to the primary only;
# a peer has no multimaster:peers, so no peer_run is written).
{%- from tpldir ~ "/map.jinja" import multimaster with context %}
{%- set master = multimaster.master %}
{%- set master_conf = master.config or salt["config.get"]("multimaster.master_config", "/etc/salt/master") %}
{%- set dropin = salt["file.join"](salt["file.dirname"](master_conf), "master.d", "multimaster-reactor.conf") %}
{%- set dataset = {} %}
{%- if master.reactor %}
{%-   do dataset.update({"reactor": [{"salt/key": ["salt://" ~ tpldir ~ "/reactor/key.sls"]}]}) %}
{%- endif %}
{%- if master.pull %}
{#-   let each peer pull the bulk of a sync point-to-point (peer_run) #}
{%-   set peer_run = salt["multimaster.pull_config"](master_conf) %}
{%-   if peer_run %}
{%-     do dataset.update({"peer_run": peer_run}) %}
{%-   endif %}
{%- endif %}
{%- if master.watch %}
{#-   the change journal of this master's roots and key dirs (Linux inotify);
      with the engines the master runs now (a master.d engines list replaces
      the master file's) #}
{%-   set engines = salt["multimaster.engines_config"](master_conf) %}
{%-   if engines %}
{%-     do dataset.update({"engines": engines}) %}
{%-   endif %}
{%- endif %}
{%- if master.sync_interval | int > 0 %}
{%-   do dataset.update({"schedule": {"multimaster-sync": {
        "function": "multimaster.sync",
        "minutes": master.sync_interval | int,
        "maxrunning": 1,
        "splay": 10}}}) %}
{%- endif %}

{%- if dataset %}
multimaster-master-file-serialize:
  file.serialize:
    - name: {{ dropin | tojson }}
    - makedirs: True
    - mode: '0644'
    - serializer: yaml
    - dataset: {{ dataset | tojson }}
{%- else %}
multimaster-master-file-serialize:
  file.absent:
    - name: {{ dropin | tojson }}
{%- endif %}

{%- if master.restart %}

{#- multimaster.restart_scheduled fails (test=True too) when the master cannot
    restart here: no service manager for the default command, a missing program #}
multimaster-master-multimaster-restart_scheduled:
  multimaster.restart_scheduled:
    - name: salt-master
    - cmd: {{ (master.restart_cmd or none) | tojson }}
    - delay: {{ master.restart_delay | tojson }}
    - onchanges:
      - multimaster-master-file-serialize
{%- endif %}
