"""The recipe's settings on the module: truncated completions masked for the loss, and bad values refused naming
their key."""

import pytest
import torch

from lightning_logra.base.batch import Rollout
from lightning_logra.train.module import RLVRModule

MODEL = "lightning_logra/data/tiny_arith"


def test_a_completion_cut_at_max_new_tokens_counts_for_nothing_when_masked():
    module = RLVRModule(MODEL, loss={"mask_truncated_completions": True})
    module.configure_model()
    eos = module.stop_token_ids()[0]
    ids = torch.tensor([[5, 6, eos], [5, 6, 7], [eos, 0, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 0, 0]])
    rollout = Rollout(ids[:, :1], torch.ones(3, 1, dtype=torch.long), ids, mask, torch.zeros(3, 3))
    assert module.trained_tokens(rollout).completion_mask.tolist() == [[1, 1, 1], [0, 0, 0], [1, 0, 0]]
    module.truncation.enabled = False
    assert module.trained_tokens(rollout) is rollout


def test_a_step_whose_completions_are_all_cut_says_it_trains_on_nothing(caplog):
    # Every completion cut (max_new_tokens too small) with the mask on trained on nothing, with no word.
    module = RLVRModule(MODEL, sampling={"max_new_tokens": 3}, loss={"mask_truncated_completions": True})
    module.configure_model()
    ids, mask = torch.tensor([[5, 6, 7], [5, 6, 8]]), torch.ones(2, 3, dtype=torch.long)
    rollout = Rollout(ids[:, :1], torch.ones(2, 1, dtype=torch.long), ids, mask, torch.zeros(2, 3))
    with caplog.at_level("WARNING"):
        assert module.trained_tokens(rollout).completion_mask.sum() == 0
    assert ("every completion of this step (and of 1 steps so far) was cut at model.sampling.max_new_tokens=3"
            in caplog.text)
    assert "set model.loss.mask_truncated_completions: false" in caplog.text


@pytest.mark.parametrize("settings, message", [
    ({"evaluation": {"num_samples": 8}}, "model.evaluation.num_samples=8 with model.evaluation.temperature=0"),
    ({"evaluation": {"num_samples": 0}}, "model.evaluation.num_samples must be a positive"),
    ({"rollouts": {"max_generation_rounds": 0}}, "model.rollouts.max_generation_rounds must be a positive"),
    ({"loss": {"entropy_coef": -0.1}}, "model.loss.entropy_coef must be a finite number ≥ 0"),
    ({"loss": {"entropy_coef": float("nan")}}, "model.loss.entropy_coef"),
    ({"evaluation": {"temperature": -1.0}}, "model.evaluation.temperature must be a finite number ≥ 0.01"),
    ({"evaluation": {"temperature": 1e-40}}, "model.evaluation.temperature must be a finite number ≥ 0.01"),
    # 1e-40 passed as positive: the logits divided by it overflowed (garbage samples, NaN kl/predicted)
    ({"sampling": {"temperature": 1e-40}}, "model.sampling.temperature must be a finite number ≥ 0.01"),
    ({"sampling": {"temperature": 0.0}}, r"model.sampling.temperature must be .* \(for greedy evaluation set "
                           r"model.evaluation.temperature: 0\)"),
])
def test_bad_recipe_settings_are_refused_naming_the_key(settings, message):
    with pytest.raises(ValueError, match=message):
        RLVRModule(MODEL, **settings)
