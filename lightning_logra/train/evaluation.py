"""Validation and test beyond greedy pass@1: with n completions of each prompt (`model.evaluation.num_samples`), the
unbiased pass@k of Chen et al. (2021) for k = 1, 2, 4, … up to n and at n, mean@n (the mean reward) and maj@n (the
reward of the answer the n completions give most often), each prompt's value averaged over the set.

pass@k = 1 − C(n − c, k) / C(n, k) for c right completions of n: the chance that at least one of k drawn without
replacement from the n is right, an unbiased estimate of the policy's pass@k where drawing only k would be noisy. A
completion counts as right when its reward is positive (the verifiable rewards are 0 or 1). maj@n compares answers:
a completion's final answer (`extract_final_answer`: the last \\boxed{…} or `Answer:` line), else its whole text
stripped of surrounding space; the most frequent wins (a tie: the one met first), and scores the reward its
completions earned.
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
