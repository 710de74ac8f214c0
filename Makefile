# The README's two commands: `make demo` (the main job: the RL demo's quick run, writing
# out/rl_demo-quick/) and `make test` (the test suite).
# Each creates .venv on first use and installs what it needs (scripts/setup_venv.sh).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test clean

$(VENV)/.installed: pyproject.toml scripts/setup_venv.sh
	PYTHON=$(PYTHON) scripts/setup_venv.sh $(VENV) test,demo,hf
	touch $@

demo: $(VENV)/.installed
	$(BIN)/portable-mx info
	$(BIN)/python examples/quickstart.py
	$(BIN)/python -m rl_demo --quick

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
