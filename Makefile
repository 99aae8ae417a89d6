# salt-multimaster: the quick start is `make demo` and `make test`.
# SALT picks the Salt line (3006, 3007, 3008); each line has its own venv and
# its own constraints file naming the exact releases tested (constraints/).
PYTHON ?= python3
SALT   ?= 3008
CONSTRAINTS := constraints/salt-$(SALT).txt
VENV   ?= .venv/$(SALT)
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.deps-stamp
PYTEST_ARGS ?=
# pytest-xdist workers for `make test` (--dist loadfile: a module and its
# clusters stay in one worker; the slowest modules go out first,
# tests/conftest.py).  The daemon tests wait on daemons a third of the
# time: with two workers two cores stood idle 38% of the run.  Salt 3008,
# 2 cores, one run each: 718 s with two workers, 538 s with three.
# 0: one process.
PYTEST_WORKERS ?= 3

ifeq ($(wildcard $(CONSTRAINTS)),)
$(error SALT=$(SALT): no $(CONSTRAINTS); supported lines: 3006 3007 3008)
endif

.PHONY: test demo venv bench docs clean

$(STAMP): setup.py $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# Dependencies only, at the exact releases of $(CONSTRAINTS): the tests
	# build and install the package themselves (a wheel for the pip path, the
	# repo as file_roots for the sync path).
	# Sphinx builds docs/ (make docs, and tests/unit/test_docs.py).
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) "salt==$(SALT).*" pyyaml pytest pytest-salt-factories pytest-xdist wheel setuptools sphinx
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=30 $(PYTEST_ARGS)

demo: $(STAMP)
	$(PY) tools/demo.py

bench: $(STAMP)
	$(PY) bench/run.py

# The documentation (reStructuredText in docs/): every warning, a broken
# reference included, fails the build.
docs: $(STAMP)
	$(VENV)/bin/sphinx-build -W --keep-going -b html docs docs/_build/html

clean:
	rm -rf .venv build dist *.egg-info .pytest_cache docs/_build
