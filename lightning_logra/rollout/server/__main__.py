"""`python -m lightning_logra.rollout.server`: `lightning-logra serve` (how RemoteEngine launches its servers)."""

import sys

from lightning_logra.rollout.server.command import main

if __name__ == "__main__":  # not in the processes vLLM spawns, which import this module again
    main(sys.argv[1:])
