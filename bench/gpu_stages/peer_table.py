"""peer_table: the optimizers users would pick instead (layer-wise GaLore, APOLLO-Mini, Adafactor, 8-bit AdamW,
Fira: bench/lib/peers.py) as rows of the memory table at the first shape; a peer not installed is a row saying
so."""

from __future__ import annotations

from bench.gpu_stages.plan import Plan, Progress
from bench.gpu_stages.rows import measure_rows


def peer_table(plan: Plan, progress: Progress) -> dict:
    """The optimizers a user would pick instead (bench/lib/peers.py), at the first shape: a peer whose package does not
    import here is a row saying so (`pip install -e .[peers]`)."""
    return measure_rows(plan, progress, {next(iter(plan.memory)): plan.peer_methods})
