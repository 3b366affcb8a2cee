"""The Lightning wiring: the module, its settings, the training modes, checkpoints and the strategies.

- module.py             RLVRModule, whose training_step reads as the recipe: rollout → reward → advantage →
                        micro-batched backward → propose → α → apply; it returns the applied Update to callbacks
- settings.py           the module's settings groups (sampling, loss, training, scoring, evaluation, rollouts,
                        export), each a dataclass that checks itself; MOVED: where each key of the flat settings went
- objective.py          PolicyGradient: the step's loss and its gradient, micro-batch by micro-batch; TruncationMask
- step_metrics.py       what a step logs of its samples: rewards, lengths, tokens, each task's mean reward
- sample_source.py      SampleSource: where a step's samples come from: the engine, its weight sync, overlapped
                        rollouts (draw, sync, state, restore, close), and their part of checkpoints; given values
                        (the codec, the collectives, its Placement), not the module
- scoring.py            a rollout's completions scored by the run's rewards, as TRL calls them
- context.py            how long a prompt may be: the model's context less its completions' room
- step_times.py         where a step's seconds go (train/wait_s, score_s, update_s, sync_s, rollout_s)
- throughput.py         perf/*: tokens per second generated and trained, each part's share of a step, MFU on a GPU
- backward_stats.py     what a step's backward passes measure besides the gradient, summed over micro-batches and ranks
- dynamic_sampling.py   DAPO's dynamic sampling: rounds until the batch's groups are learnable, which groups each rank
                        keeps
- evaluation.py         pass@k (unbiased), mean@k, maj@k of validate/test, and the module's EvaluationSteps; the test
                        report beside the checkpoint
- task_metrics.py       the reward and the evaluation metrics per task, for rows that name their task
- modes.py              DenseMode / SketchMode / LoRAMode (reduce_and_clip, propose, apply, what a checkpoint records),
                        picked once per run by training_mode, the one place that looks at the strategy
- dense.py              DenseConfig: what a dense run trains and by which optimizer (DenseStrategy's `dense`)
- optimizers.py         any torch optimizer by class path for the dense and LoRA modes (their strategies' `optimizer`);
                        the projected-matrix groups of GaLore, Fira and APOLLO, and their projectors in checkpoints
- policy.py             the policy and its tokenizer loaded from `model.model`; PromptCodec (prompts as ids, stop and
                        pad tokens); the export of a transformers folder
- lora.py               LoRA adapters through peft (the paper's comparison method); their steps reach the engine as
                        rank-2r LowRankDeltas with an explicit factor in place of a seed
- checkpoint.py         atomic checkpoint writes; the format version and settings every checkpoint carries (stamp,
                        the module's StampedCheckpoints hooks)
- digests.py            sha256 of what a checkpoint holds (inside it) and of a folder's files (SHA256SUMS), checked at
                        load, naming what is damaged
- safe_load.py          loading a checkpoint without running code from it (files and sharded folders)
- resume.py             a resumed run's optimizers take this run's settings, not the checkpoint's, and say so
- strategies/           only distribution: one device, DDP, FSDP2, Fabric; each carries its run's settings
"""
