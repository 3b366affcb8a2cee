"""kl_control: how often the predicted-KL control acts (α < α_max) at configs/qwen1_5b.yaml's sketch and
PredictedKLBudget settings, on the 1.5B shape with random weights and random rollouts, and the check's share of a
step at the config's batch."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.gpu_stages.plan import Plan, Progress, synchronize, through_cli
from bench.lib.policy_step import fixed_batch, objective
from bench.lib.shapes import qwen2_model


def budget_settings(controller) -> dict:
    keys = ("budget", "final_budget", "schedule", "anneal_steps", "alpha_max", "subset")
    return {key: getattr(controller, key) for key in keys}


def qwen1_5b_settings(plan: Plan):
    """configs/qwen1_5b.yaml through the command line's parser, on this device (`plan.kl_rank`: another rank):
    its module's settings, its sketch config (`SketchConfig`, its optimizer bound to its init_args), its
    `PredictedKLBudget` and its data module, as a run gets them; no weights or data load."""
    from lightning_logra.callbacks.kl_budget import PredictedKLBudget

    device = ["--trainer.accelerator", "gpu"] if plan.device == "cuda" else ["--trainer.accelerator", "cpu",
                                                                             "--trainer.precision", "32-true"]
    rank = [] if plan.kl_rank is None else ["--trainer.strategy.init_args.sketch.rank", str(plan.kl_rank)]
    cli = through_cli("qwen1_5b.yaml", *device, *rank, "--trainer.logger", "false")
    controller = next(c for c in cli.trainer.callbacks if isinstance(c, PredictedKLBudget))
    return cli.model.hparams, cli.trainer.strategy.config, controller, cli.datamodule.batch_size


def kl_control(plan: Plan, progress: Progress) -> dict:
    """The sketch steps of configs/qwen1_5b.yaml without generation: fixed random rollouts (new ones each step),
    sketches from the trainer's policy-gradient objective (`bench.lib.policy_step`: the config's loss, its log-prob
    chunks, the plan's micro-batch), gradient clipping at model.training.max_grad_norm, then what PredictedKLBudget
    does in a run: q = predicted KL of the proposal on `subset` responses, α = min(α_max, √(δ/q)) at the step's δ,
    merge.

    Random weights give near-uniform next-token distributions, unlike a trained model's: the rate measured here
    says whether the control can act at these settings, not how often it acts in a real run.

    Each step is timed too (synchronized): the check's seconds per checked response against the training's seconds
    per trained response give the check's share of a step at the config's own batch (prompts × generations), which
    is too large to run here; the check's fp32 passes are what a GPU runs slowest relative to bf16."""
    from lightning_logra.algo.kl import predicted_kl, step_scale
    from lightning_logra.algo.update import Update
    from lightning_logra.train.settings import TrainingSettings

    settings, sketch, controller, prompts = qwen1_5b_settings(plan)
    shape = argparse.Namespace(seed=0, **plan.kl_batch)
    device = torch.device(plan.device)
    start = time.perf_counter()
    policy = qwen2_model(plan.kl_shape, torch.bfloat16, shape.prompt_len + shape.completion_len, plan.device)
    if settings.training.gradient_checkpointing:
        policy.gradient_checkpointing_enable()  # as RLVRModule does
        policy.config.use_cache = False
    policy.train()
    (optimizer,) = sketch.build_optimizers(policy, sketch.install(policy))  # sketch Adam alone: the rest is frozen
    sketches = [p for group in optimizer.param_groups for p in group["params"]]  # their .grad is the sketch
    training = TrainingSettings(micro_batch_size=shape.micro_batch,
                                logprob_chunk_tokens=settings.training.logprob_chunk_tokens)
    step_objective = objective(policy, training, shape.completion_len, settings.loss, settings.sampling.temperature)
    subset = controller.subset if isinstance(controller.subset, int) else max(1, round(controller.subset * shape.batch))
    result = dict(shape=plan.kl_shape, rank=sketch.rank, optimizer=type(optimizer).__name__,
                  lr=optimizer.param_groups[0]["lr"], budget=budget_settings(controller), subset=subset, steps=[])
    for step in range(plan.kl_steps):
        if time.perf_counter() - start > plan.kl_budget_s:
            result["stopped"] = f"time budget of {plan.kl_budget_s:.0f} s reached after {step} steps"
            break
        shape.seed = step  # new rollouts every step, as a run has
        # Half of each group right, half wrong: fixed_batch's random rewards can make a whole group right (or
        # wrong), whose advantages, and so the step's gradient, are zero; a real run leaves such groups out.
        rewards = (torch.arange(shape.batch) % 2).float()
        batch = fixed_batch(shape, policy.config.vocab_size, rewards, settings.loss.scale_rewards).to(device)
        synchronize(device)
        step_start = time.perf_counter()
        step_objective.accumulate(batch.rollout, batch.advantages)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(sketches, settings.training.max_grad_norm))
        if not optimizer.propose():
            result["steps"].append(dict(step=step, skipped=True))
            continue
        responses = batch.head(subset).rollout
        synchronize(device)
        kl_start = time.perf_counter()
        q, _ = predicted_kl(policy, Update(low_rank=optimizer.proposal()), responses, settings.sampling.temperature)
        q = float(q)  # waits for the device
        kl_s = time.perf_counter() - kl_start
        budget = controller.budget_at(step)
        alpha = step_scale(q, budget, controller.alpha_max)
        optimizer.apply(alpha)
        synchronize(device)
        train_s = time.perf_counter() - step_start - kl_s
        result["steps"].append(dict(step=step, grad_norm=grad_norm, q=q, budget=budget, alpha=alpha,
                                    acting=alpha < controller.alpha_max, kl_s=kl_s, train_s=train_s))
        measured = [s for s in result["steps"] if not s.get("skipped")]
        result["acting_rate"] = sum(s["acting"] for s in measured) / len(measured)
        timed = measured[1:] or measured  # the first step allocates the optimizer's state
        kl_per_response = statistics.median(s["kl_s"] for s in timed) / subset
        train_per_response = statistics.median(s["train_s"] for s in timed) / shape.batch
        config_batch = prompts * settings.sampling.num_generations
        result["kl_share"] = dict(  # the check's share of a step at the config's batch, from per-response costs
            kl_s_per_response=kl_per_response, train_s_per_response=train_per_response, config_batch=config_batch,
            share=subset * kl_per_response / (subset * kl_per_response + config_batch * train_per_response))
        progress(result)
    return result
