# -*- coding: utf-8 -*-
# vim: ft=sls
{%- from tpldir ~ "/map.jinja" import multimaster with context %}

multimaster-minion-multimaster-version:
  module.run:
    - multimaster.version: []
