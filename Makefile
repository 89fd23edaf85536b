# The README's two set-up commands: `make demo` (the main job) and `make test`.
# Both create a virtualenv in $(VENV) and install the project into it from pyproject.toml.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test test-fast lint clean

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
	$(PY) -m pytest

# The unit tier (tests/unit): no server, no model run; under 2 minutes on 2 cores.
test-fast: $(VENV)/.installed-test
	$(PY) -m pytest tests/unit -q

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
