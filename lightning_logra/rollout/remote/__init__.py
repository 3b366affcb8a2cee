"""Rollouts from engine servers apart from the trainer (`lightning-logra serve`): what runs in the trainer's process.
It shares with the servers only the wire protocol (`rollout/protocol.py`), and imports nothing of theirs.

- engine.py   RemoteEngine: the `RolloutEngine` the module calls, composed of the two below
- fleet.py    the servers of a run: launched or given, up or down, a call's prompts split over them, catch-ups
- client.py   one server: its label as it last said, and the requests to it
"""

from lightning_logra.rollout.remote.client import ServerFailed
from lightning_logra.rollout.remote.engine import RemoteEngine
from lightning_logra.rollout.remote.fleet import NoServerLeft

__all__ = ["NoServerLeft", "RemoteEngine", "ServerFailed"]
