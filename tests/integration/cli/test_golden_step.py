"""Golden steps: three training steps of the shipped tiny model through the CLI in this process, for each
single-process path (sketch fp32 and bf16, dense, LoRA), compared with recorded numbers (tests/recorded/<config>.json;
tests/golden.py says what moves them and how to record them anew). The multi-process and engine paths are recorded
by their own tests.
"""

import pytest
from lightning.pytorch import Callback

from golden import RECORDED, assert_matches, checksums, recorded


class Recorder(Callback):
    def __init__(self) -> None:
        self.metrics: list[dict[str, float]] = []

    def on_fit_start(self, trainer, pl_module):
        self.start = {n: p.detach().double().clone() for n, p in pl_module.policy.named_parameters()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items() if k in RECORDED})

    def on_fit_end(self, trainer, pl_module):
        end = {n: p.detach().double() for n, p in pl_module.policy.named_parameters() if n in self.start}
        self.checksum = checksums(self.start, end)


# bf16 weights merged by stochastic rounding. Their products round by the CPU's kernels: one recording per kind of
# machine this project runs on (`golden.cpu_kernels`), tiny_arith_bf16.<kernels>.json.
CONFIGS = ["tiny_arith", "tiny_arith_bf16", "tiny_arith_dense_all", "tiny_arith_lora"]


@pytest.mark.parametrize("config", CONFIGS)
def test_three_steps_match_the_recorded_numbers(run_cli, config):
    # The config as shipped (its model, reward and data), 3 steps of 8 prompts, no validation.
    recorder = Recorder()
    cli = run_cli(config, "--trainer.max_steps", "3", "--data.init_args.batch_size", "8",
                  "--trainer.val_check_interval", "1000", fast=False, run=False)
    cli.trainer.callbacks.append(recorder)
    cli.trainer.fit(cli.model, cli.datamodule)
    expected = recorded(config, per_kernels=config == "tiny_arith_bf16")
    assert_matches(config, {"steps": recorder.metrics, **recorder.checksum}, expected)
