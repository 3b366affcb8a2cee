"""A reward that is a model: a local transformers sequence classifier scores each prompt + completion, as TRL scores
with a model given in `reward_funcs`. Like every reward it runs in a process of its own (`model.scoring.timeout_s`),
where it is loaded on first use and kept, on a device of its own choosing; its score combines with rule-based
rewards through `model.scoring.weights`."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Literal

from lightning_logra.base.settings import check_positive

log = logging.getLogger(__name__)


def _check_one_label_classifier(path: Path) -> None:
    """A causal LM's folder loaded as a classifier got a score head of random weights (rewards random, and different
    every run), and a 2-label classifier scored silently with label 0: only a one-label sequence classifier is one."""
    config = json.loads((path / "config.json").read_text())
    architectures = config.get("architectures") or []
    labels = len(config["id2label"]) if isinstance(config.get("id2label"), dict) else config.get("num_labels", 2)
    if not any(str(a).endswith("ForSequenceClassification") for a in architectures):
        raise ValueError(f"model.reward: RewardModel's path {str(path)!r} holds a {', '.join(architectures) or 'model'}"
                         ", not a sequence classifier: its score head would be random weights; give a reward model "
                         "(an AutoModelForSequenceClassification with one label)")
    if labels != 1:
        raise ValueError(f"model.reward: RewardModel's path {str(path)!r} is a classifier of {labels} labels; a reward "
                         "model has one (its logit is the score): give a one-label classifier")


class RewardModel:
    """For a config::

        reward:
          - math_answer
          - class_path: lightning_logra.rewards.RewardModel
            init_args: {path: /models/my-rm, device: cuda:1, batch_size: 16, dtype: bfloat16}
        reward_weights: [1.0, 0.5]
        reward_memory_gib: null  # a model on a GPU maps more address space than the default limit allows

    Args:
        path: a folder saved by `save_pretrained` of an `AutoModelForSequenceClassification` with one label (its
            logit is the score) and its tokenizer.
        device: where it runs ("cpu", "cuda", "cuda:1"): a device the policy does not use keeps their memory apart.
        batch_size: completions per forward pass.
        dtype: the dtype its weights are loaded in.
        max_length: inputs longer than this many tokens keep their last ones (None: the tokenizer's limit).
    """

    def __init__(self, path: str, device: str = "cpu", batch_size: int = 8,
                 dtype: Literal["float32", "bfloat16", "float16"] = "float32", max_length: int | None = None) -> None:
        if not (Path(path).expanduser() / "config.json").is_file():
            raise FileNotFoundError(f"model.reward: RewardModel's path {path!r} is not a transformers model folder "
                                    "(no config.json): give the folder a sequence classifier was saved to")
        _check_one_label_classifier(Path(path).expanduser())
        check_positive("model.reward: RewardModel's batch_size", batch_size, "number of completions", integer=True)
        check_positive("model.reward: RewardModel's max_length", max_length, "number of tokens", integer=True,
                       null="the tokenizer's limit")
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"model.reward: RewardModel's dtype must be float32, bfloat16 or float16, got {dtype!r}")
        self.path, self.device, self.batch_size = str(Path(path).expanduser()), device, batch_size
        self.dtype, self.max_length = dtype, max_length
        self._loaded: tuple[Any, Any] | None = None  # (model, tokenizer), in the process that scores

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_loaded": None}  # sent to its process as settings; it loads there

    def _load(self) -> tuple[Any, Any]:
        if self._loaded is None:
            import torch
            from transformers import AutoModelForSequenceClassification, AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.path)
            tokenizer.padding_side, tokenizer.truncation_side = "right", "left"
            if tokenizer.pad_token is None:
                tokenizer.pad_token = tokenizer.eos_token
            model = AutoModelForSequenceClassification.from_pretrained(self.path, dtype=getattr(torch, self.dtype))
            if model.config.pad_token_id is None:  # it finds each row's last token by the pad id
                model.config.pad_token_id = tokenizer.pad_token_id
            self._loaded = (model.to(self.device).eval(), tokenizer)
        return self._loaded

    def texts(self, prompts: list, completions: list, tokenizer: Any) -> list[str]:
        """What it reads: prompt then completion as text, or the conversation through its chat template."""
        if all(isinstance(p, str) and isinstance(c, str) for p, c in zip(prompts, completions)):
            return [p + c for p, c in zip(prompts, completions)]
        conversations = [(p if isinstance(p, list) else [{"role": "user", "content": p}]) +
                         (c if isinstance(c, list) else [{"role": "assistant", "content": c}])
                         for p, c in zip(prompts, completions)]
        return [tokenizer.apply_chat_template(conversation, tokenize=False) for conversation in conversations]

    def __call__(self, prompts: list, completions: list, **_: object) -> list[float]:
        import torch

        model, tokenizer = self._load()
        texts = self.texts(prompts, completions, tokenizer)
        scores: list[float] = []
        with torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                inputs = tokenizer(texts[start : start + self.batch_size], return_tensors="pt", padding=True,
                                   truncation=self.max_length is not None, max_length=self.max_length,
                                   add_special_tokens=False).to(self.device)
                scores += model(**inputs).logits[:, 0].float().tolist()
        return scores

    def __repr__(self) -> str:
        return f"RewardModel(path={self.path!r}, device={self.device!r})"
