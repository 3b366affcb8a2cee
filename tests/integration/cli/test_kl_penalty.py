"""model.loss.beta: the KL penalty to the starting policy (TRL's GRPO `beta`), per token β·(exp(r − l) − (r − l) − 1).

The gradient of one real training step (a Trainer fit, the module's own `accumulate_gradients`) is compared in
float64 with the objective written out here by hand, with the policy moved away from the reference so that the
penalty pulls; the reference is not in the checkpoint or the optimizers; beta 0 loads nothing and changes nothing;
and the CLI logs `train/kl` in each training mode.
"""

import copy
import glob
import math

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoModelForCausalLM

import lightning_logra.train.module as module_file
import lightning_logra.train.objective as objective_file
from lightning_logra.algo.logprobs import completion_logits, completion_logprobs
from lightning_logra.algo.losses import reference_kl
from lightning_logra.data.module import ArithDataModule
from lightning_logra.train.module import RLVRModule
from lightning_logra.train.strategies import SketchFSDPStrategy

G = 4  # samples per prompt; 4 prompts: 16 samples
IS_CAP = 2.0
TEMPERATURE = 0.8  # not 1, so that log-probs taken at another temperature would show
BETA = 0.5
# Subtracted from the sampler's log-prob of each completion column, so that the importance weights are far from 1
# (about e^-0.7, e^0.5, the cap 2, e^0.2): a penalty wrongly multiplied by them would change the gradient.
SHIFT = torch.tensor([-0.7, 0.5, 1.0, 0.2], dtype=torch.float64)


def half_learnable(prompts, completions, **_):
    """By position: the samples of even groups all earn 0 (advantage 0), those of odd groups 0, 1, 0, 1 (advantages
    ∓0.5 exactly with scale_rewards none)."""
    return [float(i % 2) if (i // G) % 2 else 0.0 for i in range(len(completions))]


def nothing_learnable(prompts, completions, **_):
    return [0.0] * len(completions)


def advantages_of(reward) -> torch.Tensor:
    """What the reward's advantages are, by hand (scale_rewards none: centered within each group of G)."""
    if reward is nothing_learnable:
        return torch.zeros(16, dtype=torch.float64)
    return torch.tensor([(0.5 if i % 2 else -0.5) if (i // G) % 2 else 0.0 for i in range(16)], dtype=torch.float64)


class GradientsBeforeStep(Callback):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads = {n: p.grad.clone() for n, p in pl_module.policy.named_parameters() if p.grad is not None}


def make_module(model, reward, loss_type="dapo", **loss) -> RLVRModule:
    """A module on `model` with `reward`; `loss`: settings of model.loss (beta, epsilon, ...)."""
    return RLVRModule(model, reward=reward,
                      sampling={"num_generations": G, "max_new_tokens": 4, "temperature": TEMPERATURE, "seed": 0},
                      loss={"type": loss_type, "scale_rewards": "none", **loss},
                      training={"micro_batch_size": 3, "max_grad_norm": None}, scoring={"timeout_s": None},
                      rollouts={"is_cap": IS_CAP})


def one_step(module, precision="32-true", moved=False, checkpoint=None):
    """One training step of `module` in a Trainer (dense AdamW, one CPU process); with `moved`, the policy's weights
    are first moved away from the model's files (the reference's). Returns what the tests compare."""
    module.configure_model()  # the policy and its in-process engine, so both can be changed or wrapped
    if moved:
        with torch.no_grad():
            noise = torch.Generator().manual_seed(1)
            for p in module.policy.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=noise, dtype=p.dtype))
    start = copy.deepcopy(module.policy).double()  # the weights the step's gradient is taken at
    rollouts, forwarded = [], []
    generate = module.engine.generate

    def shifted_generate(*args):
        rollout = generate(*args)
        columns = SHIFT[: rollout.completion_ids.shape[1]].to(rollout.sampler_logprobs.dtype)
        rollout.sampler_logprobs = (rollout.sampler_logprobs - columns) * rollout.completion_mask
        rollouts.append(rollout)
        return rollout

    def counted_logprobs(model, prompt_ids, *args, **kwargs):
        forwarded.append(("reference" if model is module.reference else "policy", prompt_ids.shape[0]))
        return completion_logprobs(model, prompt_ids, *args, **kwargs)

    grads = GradientsBeforeStep()
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=1, limit_val_batches=0, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[grads], precision=precision)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(module.engine, "generate", shifted_generate)
        patch.setattr(objective_file, "completion_logprobs", counted_logprobs)
        trainer.fit(module, ArithDataModule(batch_size=4))
    if checkpoint is not None:
        trainer.save_checkpoint(checkpoint)
    assert len(rollouts) == 1
    return dict(module=module, trainer=trainer, rollout=rollouts[0], start=start, grads=grads.grads,
                forwarded=forwarded, metrics={k: float(v) for k, v in trainer.callback_metrics.items()})


def token_logprobs_at(model, rollout) -> torch.Tensor:
    """log π(token) (16, C) at the sampling temperature, from the full logits (not the module's chunked path)."""
    logits = completion_logits(model, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                               rollout.completion_mask)  # (16, C, V)
    return (logits / TEMPERATURE).log_softmax(-1).gather(-1, rollout.completion_ids[..., None]).squeeze(-1)


def by_hand(step, model, reward, loss_type, beta=BETA, penalty_weight=None):
    """The step's objective and its gradient in float64, written out:

        −Σ w·A·is·l + β·Σ w·(exp(r − l) − (r − l) − 1)

    over all 16 samples, with l the policy's and r the reference's (the model's files) log-probs at the sampling
    temperature, is = min(exp(l − l_sampler), cap), and w the loss type's per-token weights. `penalty_weight`
    multiplies the penalty's terms by something else (to show that a wrong objective would be told apart)."""
    rollout, policy = step["rollout"], copy.deepcopy(step["start"])
    reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float64)
    mask = rollout.completion_mask.double()  # (16, C)
    logp = token_logprobs_at(policy, rollout)
    with torch.no_grad():
        ref = token_logprobs_at(reference, rollout)
    is_weight = ((logp.detach() - rollout.sampler_logprobs.double()) * mask).exp().clamp(max=IS_CAP) * mask
    # The module's per-token weights are float32 (1/tokens or 1/(sequences·length) rounded once): so are these.
    lengths = mask.sum(1, keepdim=True)
    w32 = {"dapo": mask.float() / float(mask.sum()), "grpo": mask.float() / (lengths.float() * 16)}[loss_type]
    w = w32.double()
    advantages = advantages_of(reward)[:, None]
    d = (ref - logp) * mask
    kl = (d.exp() - d - 1) * mask  # (16, C)
    penalty = w * kl if penalty_weight is None else w * kl * penalty_weight(is_weight, advantages)
    objective = -(w * advantages * is_weight * logp).sum() + beta * penalty.sum()
    objective.backward()
    grads = {n: p.grad for n, p in policy.named_parameters() if p.grad is not None}
    return objective.item(), grads, float((kl.sum() / mask.sum()).detach())


def assert_same_gradients(got, expected):
    """Equal to 1e-6 of each tensor's largest entry. Both are float64, but a prompt's forward pass is shared by the
    rows of a micro-batch (algo.logprobs.shared_prompt_pass), which the module splits otherwise than this file's
    one batch: a prompt's gradient is summed over other rows before its layers' backward, and transformers' RMSNorm
    computes in fp32 even in a float64 model, so such sums round at fp32. Objectives wrong in the ways the penalty
    could be fail it (test_the_penalty_adds_beta_times_the_weighted_k3_to_the_loss_and_its_gradient)."""
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        assert got[name].dtype == grad.dtype == torch.float64, name
        assert float((got[name] - grad).abs().max()) <= 1e-6 * float(grad.abs().max()), name


@pytest.fixture(scope="module")
def penalized(tiny_arith_model, tmp_path_factory):
    """One float64 step with beta > 0, the policy moved from the start, half the samples with zero advantage."""
    checkpoint = tmp_path_factory.mktemp("kl_penalty") / "step.ckpt"
    module = make_module(tiny_arith_model, half_learnable, beta=BETA)
    return one_step(module, precision="64-true", moved=True, checkpoint=checkpoint) | {"checkpoint": checkpoint}


def test_the_penalty_adds_beta_times_the_weighted_k3_to_the_loss_and_its_gradient(penalized, tiny_arith_model):
    step = penalized
    objective, grads, kl = by_hand(step, tiny_arith_model, half_learnable, "dapo")
    assert_same_gradients(step["grads"], grads)
    assert step["metrics"]["train/loss"] == pytest.approx(objective, rel=1e-6)
    # The policy moved, so the reference's log-probs differ and the penalty pulls; train/kl is its per-token mean.
    assert kl > 1e-3
    assert step["metrics"]["train/kl"] == pytest.approx(kl, rel=1e-6)
    # Every sample went through both models, the zero-advantage half included (micro-batches of 3: 3, 3, 3, 3, 3, 1).
    assert step["forwarded"] == [("reference", 3), ("policy", 3)] * 5 + [("reference", 1), ("policy", 1)]
    # Objectives that are wrong in the ways the penalty could be are told apart: no penalty, the penalty weighted by
    # the importance weight, or by the advantage.
    for wrong in ({"beta": 0.0}, {"penalty_weight": lambda is_weight, a: is_weight},
                  {"penalty_weight": lambda is_weight, a: a}):
        _, wrong_grads, _ = by_hand(step, tiny_arith_model, half_learnable, "dapo", **wrong)
        with pytest.raises(AssertionError):
            assert_same_gradients(step["grads"], wrong_grads)


def test_with_every_advantage_zero_the_penalty_alone_moves_the_policy(tiny_arith_model):
    # Nothing to learn from the rewards: every sample must still go through the backward passes, and the gradient is
    # the penalty's (grpo's per-sequence weights this time).
    step = one_step(make_module(tiny_arith_model, nothing_learnable, loss_type="grpo", beta=BETA),
                    precision="64-true", moved=True)
    _, grads, kl = by_hand(step, tiny_arith_model, nothing_learnable, "grpo")
    assert sum(float(g.norm()) ** 2 for g in grads.values()) > 1e-6
    assert_same_gradients(step["grads"], grads)
    assert step["metrics"]["train/kl"] == pytest.approx(kl, rel=1e-6)
    assert sum(rows for model, rows in step["forwarded"] if model == "policy") == 16


def test_the_reference_is_frozen_and_in_neither_the_checkpoint_nor_the_optimizers(penalized, tiny_arith_model):
    module, trainer = penalized["module"], penalized["trainer"]
    reference = module.reference
    assert reference is not None and reference is not module.policy
    # A plain attribute, not a submodule: nothing of it in the module's parameters, state_dict or the checkpoint.
    assert "reference" not in dict(module.named_children())
    reference_params = {id(p) for p in reference.parameters()}
    assert not reference_params & {id(p) for p in module.parameters()}
    checkpoint = torch.load(penalized["checkpoint"], weights_only=False)
    assert set(checkpoint["state_dict"]) == {f"policy.{k}" for k in module.policy.state_dict()}
    for optimizer in trainer.optimizers:
        assert not reference_params & {id(p) for group in optimizer.param_groups for p in group["params"]}
    # Frozen, in eval mode, in the dtype the policy trained in (64-true), and still the model's files after the step.
    assert not reference.training and not any(p.requires_grad for p in reference.parameters())
    assert {p.dtype for p in reference.parameters()} == {torch.float64}
    files = AutoModelForCausalLM.from_pretrained(tiny_arith_model, dtype=torch.float64).state_dict()
    assert reference.state_dict().keys() == files.keys()
    assert all(torch.equal(reference.state_dict()[k], files[k]) for k in files)


def test_beta_zero_loads_no_reference_and_changes_nothing(tiny_arith_model, monkeypatch):
    def no_reference(*args, **kwargs):
        raise AssertionError("beta 0 loaded a reference model")

    monkeypatch.setattr(module_file, "load_reference", no_reference)
    off = one_step(make_module(tiny_arith_model, half_learnable, beta=0.0))
    before = one_step(make_module(tiny_arith_model, half_learnable))  # built as before beta existed
    assert off["module"].reference is None and "train/kl" not in off["metrics"]
    # The zero-advantage samples are still left out (8 of 16 forwarded), and the gradient is bit for bit the same.
    assert off["forwarded"] == before["forwarded"] == [("policy", 3), ("policy", 3), ("policy", 2)]
    assert off["grads"].keys() == before["grads"].keys()
    assert all(torch.equal(off["grads"][n], before["grads"][n]) for n in before["grads"])


@pytest.mark.parametrize("beta", [-1.0, math.nan, math.inf, -math.inf])
def test_a_beta_that_is_not_a_finite_non_negative_number_is_refused(tiny_arith_model, beta):
    with pytest.raises(ValueError, match=r"model\.loss\.beta must be a finite number ≥ 0"):
        make_module(tiny_arith_model, half_learnable, beta=beta)


def test_beta_under_fsdp_is_refused_before_anything_loads(tiny_arith_model, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("weights were loaded before the refusal")

    monkeypatch.setattr(module_file, "load_policy", no_loading)
    monkeypatch.setattr(module_file, "load_reference", no_loading)
    module = make_module(tiny_arith_model, half_learnable, beta=0.04)
    # A Trainer of the strategy, attached as a fit attaches it (no processes: the check comes before any set-up).
    module.trainer = Trainer(strategy=SketchFSDPStrategy(), accelerator="cpu", devices=1, logger=False)
    module.trainer.state.fn = TrainerFn.FITTING
    with pytest.raises(ValueError,
                       match=r"model\.loss\.beta=0\.04: .*unsharded copy .* every rank .*SketchDDPStrategy"):
        module.configure_model()


@pytest.mark.parametrize("config", ["tiny_arith", "tiny_arith_dense", "tiny_arith_lora"])
def test_the_command_line_logs_the_kl_to_the_start_in_every_training_mode(run_cli, tmp_path, config):
    # Sketches, dense AdamW and LoRA (a peft policy) alike: 3 steps with model.loss.beta, train/kl logged every step.
    run_cli(config, "--model.loss.beta", "0.04", steps=3, root=tmp_path)
    events = EventAccumulator(glob.glob(str(tmp_path / "**" / "events.out.tfevents.*"), recursive=True)[0])
    events.Reload()
    kl = [e.value for e in events.Scalars("train/kl")]
    assert len(kl) == 3 and all(math.isfinite(v) and v >= 0 for v in kl), kl
    # The first step is taken at the starting weights (the reference's: no distance), the next ones after updates.
    assert kl[0] < 1e-6 and kl[1] > 0 and kl[2] > 0, kl


def test_reference_kl_is_k3_and_zero_on_padding():
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -50.0, -0.1]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -2.0, -0.2], [-1.0, 800.0, -0.1]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    kl = reference_kl(logprobs, ref, mask)
    d = (ref - logprobs.detach())
    expected = (d.exp() - d - 1) * mask
    assert torch.isnan(expected[1, 1])  # padding, where exp(850) overflows and inf·0 is NaN: masked first instead
    expected[1, 1] = 0.0
    torch.testing.assert_close(kl.detach(), expected, rtol=1e-15, atol=1e-15)
    assert (kl >= 0).all() and kl[0, 1] == 0 and kl[1, 2] == 0
    kl.sum().backward()
    slope = (1 - d.exp()) * mask  # ∂kl/∂l = 1 − e^(r−l) on real tokens, 0 on padding
    slope[1, 1] = 0.0
    torch.testing.assert_close(logprobs.grad, slope, rtol=1e-15, atol=1e-15)
