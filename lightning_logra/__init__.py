"""lightning-logra: RLVR on language models with full-parameter updates from low-rank gradient sketches.

The package, the face at its root and the rest by what it is (the layers point down: `tests/unit/test_layers.py`):

    cli, checks, export,         the face: the command line, what it checks before loading, exports, pretrained models
    fetch, paths                 from the package index, shipped files
    train/                       the Lightning module, training modes, strategies, checkpoints, the policy's loading
    rewards/                     the built-in rewards, the processes rewards run in, their resolution and scoring
    rollout/                     rollout engines (in-process, vLLM) and keeping their weights in step
    data/                        prompt sets and the embedded tasks
    algo/                        the step's math: losses, advantages, log-probs, predicted KL, the update type
    sketch/                      LoGRA's core: projections, sketched layers, sketch optimizers, the merge
    base/                        counter hashes, the rollout batch, learning-rate schedules, log lines around waits
                                 (imports nothing from the project)

Modules that moved keep their old import paths (`lightning_logra.strategy.SketchStrategy` in an older config, a
class a checkpoint's pickle names by its old module): `_MOVED` maps each to where it lives now.
"""

import importlib
import importlib.abc
import importlib.util
import sys

__version__ = "0.1.0"

_MOVED = {
    "lightning_logra.hashing": "lightning_logra.base.hashing",
    "lightning_logra.batch": "lightning_logra.base.batch",
    "lightning_logra.waits": "lightning_logra.base.waits",
    "lightning_logra.loss": "lightning_logra.algo.losses",
    "lightning_logra.logprobs": "lightning_logra.algo.logprobs",
    "lightning_logra.kl": "lightning_logra.algo.kl",
    "lightning_logra.update": "lightning_logra.algo.update",
    "lightning_logra.control": "lightning_logra.algo.step_size",
    "lightning_logra.scoring": "lightning_logra.rewards.scoring",
    "lightning_logra.module": "lightning_logra.train.module",
    "lightning_logra.schedule": "lightning_logra.base.schedule",
    "lightning_logra.checkpoint": "lightning_logra.train.checkpoint",
    "lightning_logra.strategy": "lightning_logra.train.strategies",
    "lightning_logra.fsdp": "lightning_logra.train.strategies.fsdp",
    "lightning_logra.fabric": "lightning_logra.train.strategies.fabric",
    "lightning_logra.lora": "lightning_logra.train.strategies",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module path as the module it moved to (the same module object, not a copy)."""

    def find_spec(self, name, path, target=None):
        return importlib.util.spec_from_loader(name, self) if name in _MOVED else None

    def create_module(self, spec):
        module = importlib.import_module(_MOVED[spec.name])
        spec.loader_state = module.__spec__  # its own, put back below: the import machinery sets the alias's
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state  # already run, under its own name


sys.meta_path.append(_MovedModules())
