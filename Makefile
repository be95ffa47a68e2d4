# orca-serve: two commands on a fresh machine with nothing but Python 3.11+.
#   make serve   set up, then `orca serve` (makes the demo model on first run)
#   make test    set up, run the whole test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch; on a CUDA machine override it: make TORCH_SPEC='torch' serve
TORCH_SPEC ?= torch==2.13.0
DEMO_MODEL ?= .cache/demo-llama
TCMALLOC := $(firstword $(wildcard /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 /usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4))

.PHONY: setup serve generate test test-fast bench clean

$(BIN)/orca: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e '.[test]'
	@touch $@

setup: $(BIN)/orca

$(DEMO_MODEL)/config.json: | $(BIN)/orca
	$(BIN)/orca make-demo-model $(DEMO_MODEL)

serve: setup
	$(BIN)/orca serve $(SERVE_ARGS)

generate: setup $(DEMO_MODEL)/config.json
	@mkdir -p out
	$(BIN)/orca generate --model $(DEMO_MODEL) --input examples/prompts.jsonl --output out/generations.jsonl
	@cat out/generations.jsonl

# The end-to-end tests that start stacks on two pytest-xdist workers (tests/conftest.py schedules whole
# groups: the tests that share a stack, then each module, the longest first); then tests/reliability
# alone (its shared stack's tests on one worker, its NATS-cluster module on the other), whose recovery
# times other tests' load would stretch, with the unit tests beside it at nice 19
# (tests/run_suite.sh says why).
PYTEST_WORKERS ?= 2

test: setup
	PYTHON=$(BIN)/python PYTEST_WORKERS=$(PYTEST_WORKERS) tests/run_suite.sh

test-fast: setup
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --no-loadscope-reorder -m 'not slow'

bench: setup $(DEMO_MODEL)/config.json
	LD_PRELOAD=$(TCMALLOC) $(BIN)/python benchmarks/engine_throughput.py --model $(DEMO_MODEL)

clean:
	rm -rf $(VENV) .cache out
