"""The metrics a TRL user looks for, each checked against what it must equal: token entropy, completion lengths and
how they ended, tokens seen, the step actually taken (α·η), throughput (`perf/*`), and completions logged as
text."""

import glob
import math

import pytest
import torch


def test_a_run_logs_trl_metrics_that_mean_what_they_say(run_cli, tmp_path, monkeypatch):
    from lightning_logra.train.sample_source import SampleSource

    seen = []  # every training step's rollout, as the module scored it
    draw = SampleSource.draw

    def recording(self, batch, step):
        rollout, *drawn = draw(self, batch, step)
        seen.append(rollout)
        return rollout, *drawn

    monkeypatch.setattr(SampleSource, "draw", recording)
    cli = run_cli("tiny_arith", "--model.rollouts.log_completions_every", "1", root=tmp_path)
    metrics = {k: float(v) for k, v in cli.trainer.callback_metrics.items()}
    last = seen[-1]
    lengths = last.completion_lengths.float()
    assert metrics["completions/mean_length"] == pytest.approx(float(lengths.mean()))
    assert (metrics["completions/min_length"], metrics["completions/max_length"]) == (lengths.min(), lengths.max())
    stop = cli.model.stop_token_ids()
    assert metrics["completions/terminated_ratio"] == pytest.approx(float(last.terminated(stop).float().mean()))
    assert metrics["completions/clipped_ratio"] == pytest.approx(1.0 - metrics["completions/terminated_ratio"])
    tokens = sum(int(r.prompt_mask.sum() + r.completion_mask.sum()) for r in seen)
    assert metrics["train/num_tokens"] == tokens == cli.model.num_tokens
    # η from the sketch optimizer, and the step taken at α of it
    assert metrics["train/lr"] == pytest.approx(cli.trainer.optimizers[0].param_groups[0]["lr"]) == 1e-3
    assert metrics["train/effective_lr"] == pytest.approx(metrics["kl/alpha"] * metrics["train/lr"])
    assert 0 < metrics["train/entropy"] <= math.log(cli.model.policy.config.vocab_size)
    # throughput: the last step's tokens over its seconds, and its parts' shares (the KL check's too) adding up to one
    step_s = metrics["train/step_s"]
    assert metrics["perf/generated_tokens_per_s"] * step_s == pytest.approx(float(lengths.sum()))
    last_tokens = float(last.prompt_mask.sum() + last.completion_mask.sum())
    assert metrics["perf/trained_tokens_per_s"] * step_s == pytest.approx(last_tokens)
    assert metrics["perf/share/kl"] * step_s == pytest.approx(metrics["kl/seconds"])
    assert sum(v for k, v in metrics.items() if k.startswith("perf/share/")) == pytest.approx(1.0)
    # completions as text in TensorBoard, one table per step
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(glob.glob(str(tmp_path / "**" / "events.out.tfevents.*"), recursive=True)[0],
                              size_guidance={"tensors": 0})
    events.Reload()
    texts = events.Tensors("completions/text_summary")
    assert [t.step for t in texts] == [0, 1]
    table = texts[-1].tensor_proto.string_val[0].decode()
    assert table.startswith("| prompt | completion | reward |") and table.count("\n") == 2 + 8 - 1
    # the checkpoint keeps the count of tokens seen
    checkpoint = glob.glob(str(tmp_path / "**" / "last.ckpt"), recursive=True)[0]
    assert torch.load(checkpoint, weights_only=False)["lightning_logra"]["num_tokens"] == tokens


def test_the_sketch_settings_are_logged_as_hyperparameters(run_cli, tmp_path):
    from lightning.pytorch.core.saving import load_hparams_from_yaml

    run_cli("tiny_arith", "--trainer.strategy.init_args.sketch.rank", "8", steps=1, root=tmp_path)
    hparams = load_hparams_from_yaml(glob.glob(str(tmp_path / "**" / "hparams.yaml"), recursive=True)[0])
    assert (hparams["sketch/rank"], hparams["sketch/optimizer"], hparams["sketch/optimizer/lr"]) == (8, "SketchAdam",
                                                                                                  1e-3)
    assert hparams["sketch/target_modules"] == str(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                    "down_proj"])
    assert hparams["sampling"]["num_generations"] == 8  # the module's own stay, by group


def test_data_whose_rows_name_their_task_log_the_reward_and_pass_at_k_per_task(run_cli, tmp_path, monkeypatch):
    from lightning_logra.train.module import RLVRModule

    scored = []  # each training step's rows' tasks and rewards, as the module scored them
    score = RLVRModule.score

    def recording(self, batch, rollout, n):
        rewards, per_reward = score(self, batch, rollout, n)
        if self.trainer.training:
            scored.append(([task for task in batch["task"] for _ in range(n)], rewards.tolist()))
        return rewards, per_reward

    monkeypatch.setattr(RLVRModule, "score", recording)
    cli = run_cli("tiny_arith", "--data.class_path", "conftest.TaskedArithDataModule",
                  "--model.evaluation.num_samples", "4",
                  "--model.evaluation.temperature", "1.0", root=tmp_path)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(glob.glob(str(tmp_path / "**" / "events.out.tfevents.*"), recursive=True)[0])
    events.Reload()
    logged = {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    for task in ("even", "odd"):
        expected = []
        for tasks, rewards in scored:  # the task's mean over its rows of the step; NaN for a step without one
            mine = [r for t, r in zip(tasks, rewards) if t == task]
            expected.append(sum(mine) / len(mine) if mine else math.nan)
        assert logged[f"reward/{task}/mean"] == pytest.approx(expected, nan_ok=True)
    # each task's evaluation metric is the mean over its prompts, so together, weighed by their shares of the
    # held-out prompts, they make up the whole set's
    metrics = {k: float(v) for k, v in cli.trainer.callback_metrics.items()}
    prompts = [row["task"] for row in cli.datamodule.eval_sets["validate"]]
    share = {task: prompts.count(task) / len(prompts) for task in ("even", "odd")}
    assert all(share.values())
    for key in ("pass@1", "pass@2", "pass@4", "mean@4", "maj@4"):
        combined = sum(share[task] * metrics[f"val/{task}/{key}"] for task in share if share[task])
        assert combined == pytest.approx(metrics[f"val/{key}"], abs=1e-6), key


def test_a_task_named_as_a_reward_is_refused_before_the_first_step(run_cli, tmp_path):
    # both would log reward/odd/mean
    with pytest.raises(ValueError, match=r"the tasks \['odd'\] have the names of rewards of model.reward"):
        run_cli("tiny_arith", "--data.class_path", "conftest.TaskedArithDataModule", "--model.reward", "conftest.odd",
                root=tmp_path)
