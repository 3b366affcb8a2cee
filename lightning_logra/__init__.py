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
"""

__version__ = "0.1.0"
