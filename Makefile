# Two commands on a fresh machine: `make demo` (see a model load, no GPU needed) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test lint bench dashboards

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
	$(BIN)/pytest -ra

# Regenerate grafana/dashboards/model-load.json from grafana/generate.py (commit the result).
dashboards: $(BIN)/model-load-exporter
	$(BIN)/python grafana/generate.py

bench: $(BIN)/model-load-exporter
	$(BIN)/python bench/residency.py
