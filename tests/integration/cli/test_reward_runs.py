import logging
import math

import pytest
import torch


def _fit(run_cli, reward, steps, *overrides):
    """A tiny dense run (AdamW at lr 1e-3) rewarded by `bad_rewards.<reward>` in the trainer's process, 4 samples per
    prompt, no validation; returns (its trainer, its module, the weights before it)."""
    cli = run_cli("tiny_arith_dense_all", "--model.reward", f"bad_rewards.{reward}",
                  "--model.sampling.num_generations", "4",
                  "--model.sampling.max_new_tokens", "4", "--model.training.micro_batch_size", "16",
                  "--trainer.strategy.init_args.dense.lr", "1e-3",
                  "--model.scoring.timeout_s", "null", "--trainer.limit_val_batches", "0", *overrides, steps=steps,
                  run=False)
    cli.model.configure_model()
    before = {n: p.detach().clone() for n, p in cli.model.policy.named_parameters()}
    cli.trainer.fit(cli.model, cli.datamodule)
    return cli.trainer, cli.model, before


@pytest.mark.parametrize(("reward", "error"), [
    ("one_short", r"model.reward 'bad_rewards.one_short' returned 15 rewards for 16 completions \(4 prompts × 4 "
                  r"samples\)"),
    ("string_rewards", r"model.reward 'bad_rewards.string_rewards' returned a str \('1.0'\) for completion 0: a reward "
                       r"must be a number"),
])
def test_a_wrong_number_of_rewards_or_one_that_is_not_a_number_stops_the_run_naming_the_reward(run_cli, reward, error):
    with pytest.raises(ValueError, match=error):
        _fit(run_cli, reward, 1)


def test_a_nan_reward_drops_its_group_not_the_update(run_cli, caplog):
    with caplog.at_level(logging.WARNING, logger="lightning_logra.train.module"):
        trainer, module, before = _fit(run_cli, "nan_in_first_group", 1)
    assert float(trainer.callback_metrics["train/update_skipped"]) == 0.0
    assert math.isfinite(float(trainer.callback_metrics["train/grad_norm"]))
    assert math.isfinite(float(trainer.callback_metrics["train/reward_mean"]))
    changed = [n for n, p in module.policy.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert changed  # the other three groups trained
    assert any("NaN or infinite rewards in 1 of 4 groups" in r.getMessage() for r in caplog.records)


def test_rewards_that_teach_nothing_warn_and_can_stop_the_run(run_cli, caplog):
    with caplog.at_level(logging.WARNING, logger="lightning_logra.train.module"):
        with pytest.raises(RuntimeError, match=r"model.scoring.max_unlearnable_steps=2: 2 training steps in a row had "
                                               r"nothing to learn .*'bad_rewards.always_none'"):
            _fit(run_cli, "always_none", 5, "--model.scoring.max_unlearnable_steps", "2")
    warnings = [r.getMessage() for r in caplog.records if "gave no usable reward" in r.getMessage()]
    assert len(warnings) == 2  # one per step, then the stop
