"""What the benchmarks share, imported as `from bench.lib import grid` (the tools are bench's other modules):

- `runs`: the CLI runs a few at a time, and a run's TensorBoard scalars;
- `grid`: a grid of paired-seed CLI runs, resumed, read back and summarized over seeds;
- `add3`: the add3 configs of each method (dense AdamW, LoRA, LoGRA) that quality, frontier and recipe train;
- `configs`: a shipped config's dict edited in the settings' groups (`model.loss.beta`, the dense strategy);
- `shapes`: Qwen2.5 shapes with random weights; `payloads`: a model folder's target matrices and sketched updates;
- `policy_step`: fixed rollouts and the trainer's policy-gradient objective over them, without a Trainer;
- `cosines`: cos(G, S·A) of a sketch against the dense gradient;
- `memory_rows`: bench.memory's rows, each measured in a worker process;
- `peers`: the optimizers a user would pick instead of LoGRA;
- `engine_callbacks`: callbacks a benchmark's CLI runs load (the engine's CPU time, its core);
- `trl_grpo`: one TRL GRPOTrainer run on a config's recipe, in a process of its own (bench.frameworks' TRL rows);
- `plotting`: a display-less pyplot and a figure written with its title.
"""
