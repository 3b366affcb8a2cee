"""One dense training step of RLVRModule, in a real Trainer, against a float64 gradient computed from the rollouts it
trained on: the importance-sampling weight of each token and the skipping of zero-advantage samples.

Every end-to-end run samples with the policy itself (sampler ≈ trainer, weights ≈ 1), so there a dropped or
inverted weight would go unnoticed; here the engine reports log-probs shifted by a known amount per token.
"""

import copy
import math

import pytest
import torch
from lightning.pytorch import Callback, Trainer

import lightning_logra.train.objective as objective_file
from lightning_logra.algo.logprobs import completion_logits, completion_logprobs
from lightning_logra.data.module import ArithDataModule
from lightning_logra.train.module import RLVRModule

G = 4  # samples per prompt
IS_CAP = 2.0
# Subtracted from the sampler's log-prob of each completion column, so Δ = log π_θ − log π_sampler ≈ SHIFT: weights
# about e^-0.7 = 0.50, e^0.5 = 1.65, min(e^1, 2) = 2 (capped), e^0.2 = 1.22. Dropping the weight (1), inverting it
# (e^-Δ) or losing the cap (e^1 = 2.72) each changes the gradient by far more than float32 rounding.
SHIFT = torch.tensor([-0.7, 0.5, 1.0, 0.2])


def half_learnable(prompts, completions, **_):
    """Rewards by position, so that which samples have zero advantage is known: the samples of even groups all earn
    0 (advantage 0), those of odd groups alternate 0, 1, 0, 1."""
    return [float(i % 2) if (i // G) % 2 else 0.0 for i in range(len(completions))]


class GradientsBeforeStep(Callback):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads = {n: p.grad.clone() for n, p in pl_module.policy.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module")
def step(tiny_arith_model):
    """One step on 4 prompts × 4 samples, micro-batches of 2, no clipping; returns what the test compares."""
    module = RLVRModule(tiny_arith_model, reward=half_learnable,
                        sampling={"num_generations": G, "max_new_tokens": 4, "seed": 0}, loss={"type": "dapo"},
                        training={"micro_batch_size": 2, "max_grad_norm": None}, scoring={"timeout_s": None},
                        rollouts={"is_cap": IS_CAP})
    module.configure_model()  # loads the policy and its in-process engine now, so both can be wrapped
    start = copy.deepcopy(module.policy).double()
    rollouts, forwarded = [], []
    generate = module.engine.generate

    def shifted_generate(*args):
        rollout = generate(*args)
        shift = SHIFT[: rollout.completion_ids.shape[1]]
        rollout.sampler_logprobs = (rollout.sampler_logprobs - shift) * rollout.completion_mask
        rollouts.append(rollout)
        return rollout

    def counted_logprobs(policy, prompt_ids, *args, **kwargs):
        forwarded.append(prompt_ids.shape[0])
        return completion_logprobs(policy, prompt_ids, *args, **kwargs)

    grads = GradientsBeforeStep()
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=1, limit_val_batches=0, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[grads])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(module.engine, "generate", shifted_generate)
        patch.setattr(objective_file, "completion_logprobs", counted_logprobs)
        trainer.fit(module, ArithDataModule(batch_size=4))
    assert len(rollouts) == 1
    return dict(rollout=rollouts[0], start=start, grads=grads.grads, forwarded=forwarded,
                loss=float(trainer.callback_metrics["train/loss"]))


def reference(step, with_is_weight=True):
    """The step's loss and gradient in float64, over all 16 samples (zero advantages included), with the importance
    weights min(exp Δ, cap) written out here rather than taken from the package."""
    rollout, policy = step["rollout"], step["start"]
    mask = rollout.completion_mask.double()
    logits = completion_logits(policy, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                               rollout.completion_mask)  # (16, C, V), float64
    # At temperature 1 (the module's default), the log-prob of each completion token.
    logprobs = logits.log_softmax(-1).gather(-1, rollout.completion_ids[..., None]).squeeze(-1)  # (16, C)
    delta = logprobs.detach() - rollout.sampler_logprobs.double()
    weight = delta.exp().clamp(max=IS_CAP) * mask if with_is_weight else mask
    # Odd groups' rewards 0, 1, 0, 1: mean 1/2, unbiased std √(4·(1/2)²/3) = √(1/3), so A = ±(1/2)/(√(1/3) + 1e-4).
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    advantages = torch.tensor([(a if i % 2 else -a) if (i // G) % 2 else 0.0 for i in range(16)], dtype=torch.float64)
    # dapo: every token of the batch weighs 1 / (tokens in the batch).
    loss = -(advantages[:, None] * weight * logprobs * mask).sum() / mask.sum()
    loss.backward()
    grads = {n: p.grad for n, p in policy.named_parameters() if p.grad is not None}
    policy.zero_grad(set_to_none=True)
    return loss.item(), grads, delta[mask.bool()]


def test_the_loss_weighs_each_token_by_its_truncated_importance_ratio(step):
    loss, grads, delta = reference(step)
    # The shifts did reach both sides of 1 and the cap, so the test sees the direction and the truncation.
    assert (delta < -0.5).any() and (delta > math.log(IS_CAP)).any()
    assert step["loss"] == pytest.approx(loss, rel=1e-5)
    assert step["grads"].keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(step["grads"][name].double(), grad, rtol=1e-4, atol=1e-6, msg=name)
    # Without the weights the gradient is a different one (so the comparison above can tell them apart).
    _, unweighted, _ = reference(step, with_is_weight=False)
    assert not all(torch.allclose(unweighted[n], grads[n], rtol=1e-2, atol=1e-5) for n in grads)


def test_zero_advantage_samples_are_skipped_without_changing_the_update(step):
    # Only the 8 samples of the two odd groups go through the loss's forward and backward, in micro-batches of 2;
    # the gradient still equals the one over all 16 samples (the reference includes the zero-advantage ones).
    assert step["forwarded"] == [2, 2, 2, 2]
    _, grads, _ = reference(step)
    for name, grad in grads.items():
        torch.testing.assert_close(step["grads"][name].double(), grad, rtol=1e-4, atol=1e-6, msg=name)
