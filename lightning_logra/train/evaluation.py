"""Validation and test beyond greedy pass@1: with n completions of each prompt (`model.evaluation.num_samples`), the
unbiased pass@k of Chen et al. (2021) for k = 1, 2, 4, … up to n and at n, mean@n (the mean reward) and maj@n (the
reward of the answer the n completions give most often), each prompt's value averaged over the set.

pass@k = 1 − C(n − c, k) / C(n, k) for c right completions of n: the chance that at least one of k drawn without
replacement from the n is right, an unbiased estimate of the policy's pass@k where drawing only k would be noisy. A
completion counts as right when its reward is positive (the verifiable rewards are 0 or 1). maj@n compares answers:
a completion's final answer (`extract_final_answer`: the last \\boxed{…} or `Answer:` line), else its whole text
stripped of surrounding space; the most frequent wins (a tie: the one met first), and scores the reward its
completions earned.

`EvaluationSteps` is the module's validate and test: the completions drawn, scored, and their metrics logged.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from lightning_logra.rewards import extract_final_answer
from lightning_logra.rollout import find_sync
from lightning_logra.train.scoring import completion_token_lists
from lightning_logra.train.task_metrics import TaskTally, task_index


def ks(n: int) -> list[int]:
    """The k reported for n samples: 1, 2, 4, … below n, and n."""
    return sorted({2**i for i in range(n.bit_length()) if 2**i < n} | {n})


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from c right completions of n (Chen et al. 2021), as a stable product."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def vote_key(text: str) -> str:
    """What maj@n compares: the completion's final answer if it states one, else its text stripped."""
    answer = extract_final_answer(text)
    return (answer if answer is not None else text).strip()


def majority(texts: list[str], rewards: list[float]) -> float:
    """The reward of the most frequent answer among one prompt's completions (a tie: the answer met first)."""
    keys = [vote_key(text) for text in texts]
    counts = Counter(keys)
    best = max(counts.values())
    winner = next(key for key in keys if counts[key] == best)
    return rewards[keys.index(winner)]


def sample_metrics(rewards: torch.Tensor, texts: list[str], stage: str) -> dict[str, torch.Tensor]:
    """Per prompt (rewards (prompts, n), the completions' texts in the same order): pass@k for every k of `ks(n)`,
    mean@n and maj@n, each a (prompts,) tensor for the set's mean."""
    prompts, n = rewards.shape
    right = (rewards > 0).sum(1).tolist()
    metrics = {f"{stage}/pass@{k}": torch.tensor([pass_at_k(n, c, k) for c in right]) for k in ks(n)}
    metrics[f"{stage}/mean@{n}"] = rewards.float().mean(1).cpu()
    rows = rewards.tolist()
    metrics[f"{stage}/maj@{n}"] = torch.tensor([majority(texts[p * n : (p + 1) * n], rows[p]) for p in range(prompts)])
    return metrics


def per_prompt_metrics(rewards: torch.Tensor, texts: list[str], n: int, stage: str) -> dict[str, torch.Tensor]:
    """An evaluation batch's metrics per prompt, from its n completions' rewards (N,) and texts: `<stage>/pass@1` for
    one, and with more, pass@k for k = 1, 2, 4, … and mean@n, maj@n (`sample_metrics`)."""
    if n == 1:
        return {f"{stage}/pass@1": rewards}
    return sample_metrics(rewards.view(-1, n), texts, stage)


def report_path(ckpt_path: str | None, log_dir: str | None) -> Path:
    """Where `lightning-logra test` writes its table as JSON: beside the checkpoint tested (`last.ckpt` →
    `last.test.json`, a sharded checkpoint's folder likewise), else in the run's log folder (`test.json`)."""
    if ckpt_path:
        path = Path(ckpt_path)
        return path.parent / f"{path.stem if path.is_file() else path.name}.test.json"
    return Path(log_dir or ".") / "test.json"


def write_report(metrics: dict[str, float], path: Path, details: dict[str, Any]) -> str:
    """The test metrics as a markdown table (returned) and as JSON at `path` (written whole: a temporary file in the
    same folder, renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps({**details, "metrics": metrics}, indent=1) + "\n")
    os.replace(partial, path)
    rows = [f"| {key} | {value:.4f} |" for key, value in sorted(metrics.items(), key=lambda kv: _order(kv[0]))]
    return "\n".join(["| metric | value |", "|---|---:|", *rows])


def _order(key: str) -> tuple[str, int]:
    """pass@2 before pass@16: by name, then by k."""
    name, _, k = key.partition("@")
    return name, int(k) if k.isdigit() else 0


EVAL_STEP = -1  # the step an evaluation's prompts are seeded with: apart from every training step's


class EvaluationSteps:
    """validate and test as an RLVRModule runs them, mixed into it: `model.evaluation.num_samples` completions of each
    prompt, scored, their metrics logged (and per task, for data whose rows name their task). It uses the module's
    `generate`, `score`, `samples`, `eval_sampling`, `tokenizer`, `task_names` and `sum_over_ranks`."""

    tally: TaskTally | None = None  # an evaluation set's metrics per task, summed over its batches

    def evaluate(self, batch: dict[str, list[Any]], stage: str) -> None:
        """`model.evaluation.num_samples` completions of each prompt at its temperature, scored: `<stage>/pass@1`
        for one, and with more, pass@k for k = 1, 2, 4, … and mean@k, maj@k (`sample_metrics`); for data
        whose rows name their task, each also per task at the set's end (`<stage>/<task>/pass@1`)."""
        n = self.hparams.evaluation.num_samples
        rollout = self.generate(batch, n, self.eval_sampling, EVAL_STEP)
        rewards, _ = self.score(batch, rollout, n)
        texts = [] if n == 1 else self.tokenizer.batch_decode(completion_token_lists(rollout),
                                                               skip_special_tokens=True)
        per_prompt = per_prompt_metrics(rewards, texts, n, stage)  # {key: (prompts,)}
        for key, values in per_prompt.items():
            self.log(key, values.mean().to(self.device), prog_bar=key == f"{stage}/pass@1", batch_size=len(values),
                     sync_dist=True)
        if self.tally is not None:
            self.tally.add(task_index(self.tally.names, batch["task"]), per_prompt)

    def validation_step(self, batch: dict[str, list[Any]], batch_idx: int) -> None:
        self.evaluate(batch, "val")

    def test_step(self, batch: dict[str, list[Any]], batch_idx: int) -> None:
        self.evaluate(batch, "test")

    def on_validation_epoch_end(self) -> None:
        self.log_task_metrics()

    def on_test_epoch_end(self) -> None:
        self.log_task_metrics()

    def log_task_metrics(self) -> None:
        if self.tally is not None:  # reduced over ranks already: every rank logs the same values (their mean)
            self.log_dict(self.tally.compute(self.sum_over_ranks, self.device), sync_dist=True)

    def on_validation_start(self) -> None:
        self.samples.finish_queued()  # the engine is used here: it first finishes what it was given
        self._prepare_evaluation()

    def on_test_start(self) -> None:
        self._prepare_evaluation()

    def _prepare_evaluation(self) -> None:
        self.samples.use_sync(find_sync(self.trainer.callbacks), self.policy)
        self.samples.attach(self.engine_tensors)
        names = self.task_names()  # an evaluation's metrics per task, when the data names tasks
        self.tally = TaskTally(names) if names else None
