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

# The unit tier runs in $(TEST_WORKERS) processes (pytest-xdist): its tests wait on subprocesses and
# sockets more than they compute. The tiers with real servers and compiles stay in one process: two
# of them at once on 2 cores would only share the cores, and their timeouts are sized for one.
TEST_WORKERS ?= 2

test: lint
	$(PY) -m pytest tests/unit -m "not slow" -n $(TEST_WORKERS)
	$(PY) -m pytest -m "not slow" --ignore=tests/unit

# The slow tier (tests marked slow: end-to-end runs of minutes, e.g. own models through every backend);
# CI runs it after `make test`. In $(TEST_WORKERS) processes, a file (the container tier: all of it) to
# one process (tests/conftest.py): the image builds wait on downloads and disk while the other compiles.
test-slow: $(VENV)/.installed-test
	$(PY) -m pytest -m slow -n $(TEST_WORKERS) --dist loadfile

# The unit tier (tests/unit): no server, no model run; under 2 minutes on 2 cores.
test-fast: $(VENV)/.installed-test
	$(PY) -m pytest tests/unit -q -n $(TEST_WORKERS)

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
