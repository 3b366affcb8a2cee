"""Golden steps: three training steps of the shipped tiny model through the CLI in this process, for each
single-process path (sketch fp32 and bf16, dense, LoRA), compared with recorded numbers (tests/golden.py says what
moves them and how to record them anew). The multi-process and engine paths record theirs beside their own tests.
"""

import pytest
from lightning.pytorch import Callback

from golden import RECORDED, assert_matches, checksums, for_these_kernels


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


GOLDEN = {
    "tiny_arith": {
        "steps": [
            {"kl/q": 0.24068361520767212, "kl/alpha": 0.14413243532180786, "train/reward_mean": 0.484375,
             "train/loss": -0.17122025787830353, "train/grad_norm": 2.8450348377227783},
            {"kl/q": 0.10316683351993561, "kl/alpha": 0.22000129520893097, "train/reward_mean": 0.3125,
             "train/loss": -0.18735386431217194, "train/grad_norm": 1.6494375467300415},
            {"kl/q": 0.0620218962430954, "kl/alpha": 0.283551961183548, "train/reward_mean": 0.265625,
             "train/loss": -0.09054061770439148, "train/grad_norm": 2.308978796005249},
        ],
        "delta_weighted_sum": -0.012594680725528017,
        "delta_norm": 0.35988459615929513,
        "lr": 1e-3,  # the config's (sketch.optimizer.init_args.lr): what bounds the weighted sum's noise
    },
    "tiny_arith_dense_all": {
        "steps": [
            {"train/reward_mean": 0.484375, "train/loss": -0.17122027277946472, "train/grad_norm": 3.9117965698242188},
            {"train/reward_mean": 0.296875, "train/loss": -0.18954341113567352, "train/grad_norm": 2.180875539779663},
            {"train/reward_mean": 0.1875, "train/loss": -0.0668368861079216, "train/grad_norm": 3.863443374633789},
        ],
        "delta_weighted_sum": 0.13395234603806272,
        "delta_norm": 0.17162955391068982,
        "lr": 1e-4,  # the config's (model.lr)
    },
    # Recorded 2026-12-02 from main at 89031cb (before the tiers): LoRA. (bf16 weights: GOLDEN_BF16, below.)
    "tiny_arith_lora": {
        "steps": [
            {"train/reward_mean": 0.484375, "train/loss": -0.17122018337249756, "train/grad_norm": 1.239761471748352},
            {"train/reward_mean": 0.234375, "train/loss": -0.1009584367275238, "train/grad_norm": 1.0299499034881592},
            {"train/reward_mean": 0.109375, "train/loss": -0.04382789134979248, "train/grad_norm": 0.5021739602088928},
        ],
        "delta_weighted_sum": 0.6477723905062184,
        "delta_norm": 1.3964079461239187,
        "lr": 0.002,
    },
}

# bf16 weights merged by stochastic rounding. Their products round by the CPU's kernels (AVX2 emulates them; AVX-512
# with bf16 instructions computes them, and a step's gradient norm moves by 1%): one recording per kind of machine
# this project runs on (`golden.cpu_kernels`). The AVX2 numbers were recorded 2026-12-02 from main at 89031cb; the
# AVX-512 ones on 2026-12-03 from main at 52683aa, whose step reproduces the AVX2 numbers to the last digit when
# torch runs AVX2 kernels (ATEN_CPU_CAPABILITY=avx2). The AVX-512 ones with AMX on 2026-12-05 from main at 044c6d9,
# whose step reproduces the AVX-512 numbers' losses, norms and weights exactly when oneDNN is kept off AMX
# (ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16).
GOLDEN_BF16 = {
    "AVX2": {
        "steps": [
            {"train/reward_mean": 0.5, "train/loss": -0.17349867522716522, "train/grad_norm": 2.657141923904419,
             "kl/q": 6.176585429784609e-06, "kl/alpha": 4.0},
            {"train/reward_mean": 0.3125, "train/loss": -0.1854909062385559, "train/grad_norm": 1.590154767036438,
             "kl/q": 2.4254700292658526e-06, "kl/alpha": 4.0},
            {"train/reward_mean": 0.359375, "train/loss": -0.2055453360080719, "train/grad_norm": 2.2325010299682617,
             "kl/q": 3.282446414232254e-06, "kl/alpha": 4.0},
        ],
        "delta_weighted_sum": -0.03045409929936346,
        "delta_norm": 0.0671425432612865,
        "lr": 5e-06,
        "sum_tolerance": 0.001,
    },
    "AVX512+bf16": {
        "steps": [
            {"train/reward_mean": 0.5, "train/loss": -0.17343416810035706, "train/grad_norm": 2.62475848197937,
             "kl/q": 6.232348368939711e-06, "kl/alpha": 4.0},
            {"train/reward_mean": 0.3125, "train/loss": -0.18643306195735931, "train/grad_norm": 1.5918587446212769,
             "kl/q": 2.462000793457264e-06, "kl/alpha": 4.0},
            {"train/reward_mean": 0.359375, "train/loss": -0.20587903261184692, "train/grad_norm": 2.238046407699585,
             "kl/q": 3.2789394026622176e-06, "kl/alpha": 4.0},
        ],
        "delta_weighted_sum": -0.02745802357553845,
        "delta_norm": 0.06712832708817393,
        "lr": 5e-06,
        "sum_tolerance": 0.001,
    },
    "AVX512+bf16+AMX": {
        "steps": [
            {"train/reward_mean": 0.5, "train/loss": -0.17343062162399292, "train/grad_norm": 2.6251630783081055,
             "kl/q": 6.237105935724685e-06, "kl/alpha": 4.0},
            {"train/reward_mean": 0.3125, "train/loss": -0.18608373403549194, "train/grad_norm": 1.5894615650177002,
             "kl/q": 2.4585579012637027e-06, "kl/alpha": 4.0},
            {"train/reward_mean": 0.359375, "train/loss": -0.20639611780643463, "train/grad_norm": 2.245227098464966,
             "kl/q": 3.2755342544987798e-06, "kl/alpha": 4.0},
        ],
        "delta_weighted_sum": -0.027768130107595816,
        "delta_norm": 0.06714289949904373,
        "lr": 5e-06,
        "sum_tolerance": 0.001,
    },
}


@pytest.mark.parametrize("config", sorted([*GOLDEN, "tiny_arith_bf16"]))
def test_three_steps_match_the_recorded_numbers(run_cli, config):
    # The config as shipped (its model, reward and data), 3 steps of 8 prompts, no validation.
    recorder = Recorder()
    cli = run_cli(config, "--trainer.max_steps", "3", "--data.init_args.batch_size", "8",
                  "--trainer.val_check_interval", "1000", fast=False, run=False)
    cli.trainer.callbacks.append(recorder)
    cli.trainer.fit(cli.model, cli.datamodule)
    expected = for_these_kernels(GOLDEN_BF16) if config == "tiny_arith_bf16" else GOLDEN[config]
    assert_matches(config, {"steps": recorder.metrics, **recorder.checksum}, expected)
