"""KLFromStart: the measured distance from the starting policy, KL(π_t ‖ π_0), exact against a float64 reference, zero
before any step, and logged by a real run at every validation."""

import copy
import glob

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import CONFIGS, make_tiny_qwen2
from lightning_logra.algo.logprobs import completion_logits
from lightning_logra.base.batch import Rollout
from lightning_logra.callbacks import KLFromStart


def _rollout(n=5, prompt=4, completion=6):
    g = torch.Generator().manual_seed(3)
    mask = torch.ones(n, completion, dtype=torch.long)
    mask[1, 2:] = 0  # shorter completions, and one with no token at all
    mask[3, :] = 0
    # (no left padding: in float64, transformers' eager attention turns a fully masked padding row into NaN)
    prompt_mask = torch.ones(n, prompt, dtype=torch.long)
    return Rollout(torch.randint(0, 97, (n, prompt), generator=g), prompt_mask,
                   torch.randint(0, 97, (n, completion), generator=g), mask, torch.zeros(n, completion))


def _dense_kl(policy, reference, rollout, temperature):
    """Σ over completion tokens of KL(π_policy ‖ π_reference), from both models' whole float64 logits."""
    args = (rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids, rollout.completion_mask)
    with torch.no_grad():
        logp = torch.log_softmax(completion_logits(policy, *args) / temperature, -1)  # (n, C, V)
        logq = torch.log_softmax(completion_logits(reference, *args) / temperature, -1)
    per_token = (logp.exp() * (logp - logq)).sum(-1)  # (n, C)
    return per_token[rollout.completion_mask.bool()].sum()


def test_the_kl_from_the_start_equals_a_dense_float64_reference_chunk_by_chunk():
    reference = make_tiny_qwen2(dtype=torch.float64)
    policy = copy.deepcopy(reference)
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(0.05 * torch.randn_like(param))
    rollout = _rollout()
    callback = KLFromStart(chunk=2)  # 3 chunks, one holding the empty completion
    callback.reference = reference
    total, tokens = callback.kl_sum(policy, rollout, temperature=0.7)
    expected = _dense_kl(policy, reference, rollout, 0.7)
    assert tokens == rollout.completion_mask.sum()
    assert total > 1e-3
    assert total.item() == pytest.approx(expected.item(), rel=1e-12)
    same, _ = callback.kl_sum(reference, rollout, temperature=0.7)
    assert same.item() == 0.0  # π_0 against itself: exactly nothing


@pytest.mark.parametrize("key", ["prompts", "samples", "chunk"])
@pytest.mark.parametrize("value", [0, -1, 2.5])
def test_bad_settings_are_refused_naming_the_key(key, value):
    with pytest.raises(ValueError, match=f"KLFromStart: {key} must be a positive integer"):
        KLFromStart(**{key: value})


def _scalars(root):
    events = EventAccumulator(glob.glob(str(root / "**" / "events.out.tfevents.*"), recursive=True)[0])
    events.Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_a_run_logs_the_distance_it_travelled_at_every_validation(run_cli, tmp_path, tiny_arith_model):
    callbacks = tmp_path / "callbacks.yaml"
    callbacks.write_text("trainer:\n  callbacks:\n"
                         "    - class_path: lightning_logra.callbacks.KLFromStart\n"
                         "      init_args: {prompts: 6, samples: 3}\n")
    run_cli(CONFIGS / "tiny_arith_dense.yaml", "--config", str(callbacks), "--trainer.strategy.init_args.dense.lr",
            "1e-2", "--model.export.dir", str(tmp_path / "trained"), steps=4, root=tmp_path / "fit")
    travelled = _scalars(tmp_path / "fit")["val/kl_from_start"]
    assert len(travelled) == 2  # steps 2 and 4 (val_check_interval 2)
    assert all(0 < kl < 10 for kl in travelled)
    # Before any step the policy is π_0: the same measurement reads exactly 0.
    run_cli(CONFIGS / "tiny_arith_dense.yaml", "--config", str(callbacks), command="validate",
            root=tmp_path / "start")
    assert _scalars(tmp_path / "start")["val/kl_from_start"] == [0.0]
    # A validate of the trained folder (as another trainer would leave it), measured from the model it started from
    # (KLFromStart's `start`), reads the distance the run logged at its end
    start = tmp_path / "measured_from.yaml"
    start.write_text(callbacks.read_text().replace("samples: 3}", f"samples: 3, start: {tiny_arith_model}}}"))
    run_cli(CONFIGS / "tiny_arith_dense.yaml", "--config", str(start), "--model.model", str(tmp_path / "trained"),
            command="validate", root=tmp_path / "elsewhere")
    assert _scalars(tmp_path / "elsewhere")["val/kl_from_start"] == pytest.approx([travelled[-1]], rel=1e-5)


def test_with_a_kl_penalty_the_measurement_shares_its_reference(run_cli, tmp_path):
    # model.loss.beta > 0 already keeps π_0 in every process: the measurement uses that copy, not a second one.
    callbacks = tmp_path / "callbacks.yaml"
    callbacks.write_text("trainer:\n  callbacks:\n"
                         "    - class_path: lightning_logra.callbacks.KLFromStart\n"
                         "      init_args: {prompts: 4, samples: 2}\n")
    cli = run_cli(CONFIGS / "tiny_arith_dense.yaml", "--config", str(callbacks), "--model.loss.beta", "0.04", steps=2,
                  root=tmp_path / "fit")
    measurement = next(c for c in cli.trainer.callbacks if isinstance(c, KLFromStart))
    assert cli.model.reference is not None and measurement.reference is cli.model.reference
    assert _scalars(tmp_path / "fit")["val/kl_from_start"][0] > 0
