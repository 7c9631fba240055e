# Mini-Infer: `make run` (the main job) and `make test` (the whole suite) install first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install run test lint bench clean

install: $(STAMP)
	@$(BIN)/mini-infer fetch-model >/dev/null
	@# The C++ paged-attention kernel is built once per machine (cached under the cache dir), here
	@# rather than inside the first request or test; without a compiler the engine falls back.
	@$(BIN)/python -c "from engine.kernels.cpu.paged_attention import load; load()"
	@$(BIN)/python -c "from engine.kernels.cpu.quant_gemm import load; load()"

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[serve,demo,dev]'
	@touch $(STAMP)

run: install
	$(BIN)/mini-infer demo

test: install
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

bench: install
	$(BIN)/mini-infer bench engine

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
