# Two entry points for a fresh machine: `make demo` and `make test`. Both set everything up first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: setup demo test lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The exact CPU build first: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q --no-compile torch==2.13.0
	$(PY) -m pip install -q --no-compile -e '.[all,dev]'
	# pip byte-compiles on one core; this uses every core. A file meant for a newer Python
	# (torch ships one) does not compile: pip skips such files too, so the status is not kept.
	$(PY) -m compileall -q -q -j 0 $(VENV)/lib || true
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(VENV)/bin/tracehound demo

test: setup
	bash scripts/test.sh

lint: setup
	bash scripts/test.sh --lint-only

bench: setup
	$(PY) bench/detection.py

clean:
	rm -rf $(VENV) .typecheck .mypy_cache .ruff_cache .pytest_cache .tracehound
