# Two entry points for a fresh machine: `make demo` (the main job) and `make test`.
# Both create .venv if needed and install torch==2.13.0 *first* so pip never resolves an
# unpinned torch (which would pull several GB of CUDA wheels on a CPU machine).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0

.PHONY: install test demo plan lint bench clean

$(BIN)/.installed: setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[test,viz]"
	touch $@

install: $(BIN)/.installed

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: install lint
	$(BIN)/python -m pytest -q tests

demo: install
	$(BIN)/mp-bridge demo

plan: install
	$(BIN)/mp-bridge plan --world 8 --encoder tp=2,dp=4 --llm tp=2,cp=2,dp=2

bench: install
	$(BIN)/python bench/bridge.py
	$(BIN)/python bench/lm_head.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
