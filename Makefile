# Two commands on a fresh machine:  `make demo`  and  `make test`.
# Both create .venv and install what they need. torch is pinned to 2.13.0: on a machine without an
# NVIDIA GPU pip takes the local CPU build; with a GPU we hide local wheel folders so pip takes the
# normal CUDA build from the index.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tidal-installed
TORCH := torch==2.13.0

.PHONY: install demo demo-cycle test lint bench clean

$(STAMP): pyproject.toml Makefile
	command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get install -y -qq bubblewrap; } || \
	    { echo "jobs run sandboxed by bubblewrap: sudo apt-get install bubblewrap" >&2; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	    PIP_FIND_LINKS= $(PY) -m pip install -q $(TORCH); \
	else \
	    $(PY) -m pip install -q $(TORCH); \
	fi
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/tidal demo
	@echo "Next: a day of lending serving GPUs to spot jobs and taking them back: make demo-cycle (~6 min)"

demo-cycle: $(STAMP)
	$(VENV)/bin/tidal demo cycle

test: $(STAMP)
	$(VENV)/bin/ruff check src tests lab examples
	$(VENV)/bin/mypy
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadgroup --durations=20 tests lab/tests

# The rules are pyproject.toml's [tool.ruff.lint] (E501 on: lines within 110). The code is not laid out by
# `ruff format` (it would rewrite 238 files' hand-aligned tables and argument lists), so that is not checked.
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests lab examples

bench: $(STAMP)
	$(VENV)/bin/tidal bench ckpt --size-gb 1 --repeat 5

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
