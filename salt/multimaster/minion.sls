# -*- coding: utf-8 -*-
# vim: ft=sls
# The minion's master list and HA settings (minion.d drop-in) and the master
# key it trusts.  The minion restarts in the background, after the state run
# returned, only when one of them changed.
{%- from tpldir ~ "/map.jinja" import multimaster with context %}
{%- set restart = multimaster.minion_restart %}
{%- set restart_cmd = multimaster.minion_restart_cmd or none %}

multimaster-minion-multimaster-master_key:
{%- if multimaster.master_pub or multimaster.master_pub_source or multimaster.master_finger %}
  multimaster.master_key:
    - name: {{ "master_sign.pub" if multimaster.topology == "signed" else "minion_master.pub" }}
    {%- if multimaster.master_pub %}
    - contents_pillar: multimaster:master_pub
    {%- elif multimaster.master_pub_source %}
    - source: {{ multimaster.master_pub_source | tojson }}
    {%- endif %}
    {%- if multimaster.master_finger %}
    - master_finger: {{ multimaster.master_finger | tojson }}
    {%- endif %}
    - topology: {{ multimaster.topology | tojson }}
    - restart: {{ restart | tojson }}
    - restart_cmd: {{ restart_cmd | tojson }}
    - restart_delay: {{ multimaster.minion_restart_delay | tojson }}
{%- else %}
  test.succeed_without_changes:
    - name: "No expected master key in pillar (multimaster:master_pub, master_pub_source or master_finger): not managed"
{%- endif %}

multimaster-minion-multimaster-minion_config:
  multimaster.minion_config:
    - name: {{ multimaster.minion_config | tojson }}
    - masters: {{ multimaster.masters | tojson }}
    {%- for key, value in multimaster.minion | dictsort %}
    - {{ key }}: {{ value | tojson }}
    {%- endfor %}
    - restart: {{ restart | tojson }}
    - restart_cmd: {{ restart_cmd | tojson }}
    - restart_delay: {{ multimaster.minion_restart_delay | tojson }}
