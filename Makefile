# The README's two set-up commands: `make demo` (the main job) and `make test`.
# Both create a virtualenv in $(VENV) and install the project into it from pyproject.toml.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test test-fast test-slow lint clean

$(VENV)/.installed-%: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --editable ".[$*]"
	touch $@

demo: $(VENV)/.installed-demo
	$(PY) -m service.demo

lint: $(VENV)/.installed-test
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

test: lint
	$(PY) -m pytest -m "not slow"

# The slow tier (tests marked slow: end-to-end runs of minutes, e.g. own models through every backend);
# CI runs it after `make test`.
test-slow: $(VENV)/.installed-test
	$(PY) -m pytest -m slow

# The unit tier (tests/unit): no server, no model run; about 2 minutes on 2 cores.
test-fast: $(VENV)/.installed-test
	$(PY) -m pytest tests/unit -q

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
