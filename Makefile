# The README's two commands. Each sets up the environment first (scripts/setup.sh: creates $(VENV) and installs
# what is missing; seconds once done), then:
#   make train    trains the embedded default: lightning-logra fit --config configs/tiny_arith.yaml
#   make test     runs the tests: python -m pytest tests -q
# ARGS adds options (make train ARGS="--trainer.max_steps 20", make test ARGS="-m 'not integration'");
# VENV picks the environment (default .venv; CI uses a fresh .venv-ci); DEVICE=cpu|gpu overrides the detection.
VENV ?= .venv
ARGS ?=

.PHONY: setup train test

setup:
	VENV="$(VENV)" bash scripts/setup.sh

train: setup
	"$(VENV)/bin/lightning-logra" fit --config configs/tiny_arith.yaml $(ARGS)

test: setup
	"$(VENV)/bin/python" -m pytest tests -q $(ARGS)
