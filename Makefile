# salt-multimaster: the quick start is `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.deps-stamp
PYTEST_ARGS ?=

.PHONY: test demo venv bench clean

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# Dependencies only: the tests build and install the package themselves
	# (a wheel for the pip path, the repo as file_roots for the sync path).
	$(PY) -m pip install --quiet "salt>=3007" pyyaml "pytest>=7" "pytest-salt-factories>=1.0.0" wheel setuptools
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

demo: $(STAMP)
	$(PY) tools/demo.py

bench: $(STAMP)
	$(PY) bench/run.py

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
