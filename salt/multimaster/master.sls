# -*- coding: utf-8 -*-
# vim: ft=sls
# On the primary master's host (apply to its own minion): a master.d drop-in
# with a reactor on salt/key that replicates minion keys to the peers, the
# peer_run grant that lets each configured peer pull a sync's bulk, and an
# optional schedule for a periodic full `multimaster.sync`.  The master
# restarts in the background (after the state run returned) when it changed;
# where it cannot restart (no service manager) the state fails and says so.
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
