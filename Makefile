# The README's two set-up commands: `make demo` (the main job) and `make test`.
# Both create a virtualenv in $(VENV) and install the project into it from pyproject.toml.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test test-fast test-slow gpu-dry-run image lint clean

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

# The GPU headline run, dry, in a stand-in of the GPU machine (docs/benchmarks.md, "On a GPU machine"):
# about 4 minutes (the stand-in: 3 more minutes and 5 GB the first time). The slow tier runs it too.
gpu-dry-run:
	bash benchmarks/gpu_headline.sh --dry-run

# The CPU image (Dockerfile) with podman, on a Debian + Python base made here when missing (no registry
# needed); the image's reference is the last line printed. docs/deployment.md: options, the GPU image.
image:
	@bash deploy/podman/image.sh cpu

clean:
	rm -rf $(VENV) .standin .carry .pytest_cache .ruff_cache *.egg-info
