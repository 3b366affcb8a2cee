"""Lightning DataModules for RLVR: batches of prompt rows, one batch per optimizer step.

The training stream is a pure function of (seed, step): batch b is a slice of the permutation of epoch
b // batches_per_epoch, drawn from a generator seeded with seed + epoch. The loader starts at the trainer's
global step, so a resumed run sees exactly the prompts an uninterrupted run would have seen.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset, Sampler

from lightning_logra.data.arith import ArithPrompts
from lightning_logra.data.prompts import PromptDataset


class StepBatchSampler(Sampler[list[int]]):
    """Endless batches of distinct indices; global batch b depends only on (seed, b). Starts at batch `start`.

    With several ranks, each takes its contiguous slice of every global batch, so the ranks together see exactly
    the batches of a single-process run.
    """

    def __init__(self, size: int, batch_size: int, seed: int, start: int = 0, rank: int = 0,
                 world_size: int = 1) -> None:
        if batch_size > size:
            raise ValueError(f"data.batch_size={batch_size} is larger than the training set ({size} prompts)")
        if batch_size % world_size:
            raise ValueError(f"data.batch_size={batch_size} (the global batch) must be divisible by the "
                             f"{world_size} processes")
        self.size, self.batch_size, self.seed, self.start = size, batch_size, seed, start
        self.per_epoch = size // batch_size  # the remainder of each permutation is dropped
        local = batch_size // world_size
        self.local = slice(rank * local, (rank + 1) * local)

    def __iter__(self) -> Iterator[list[int]]:
        batch = self.start
        while True:
            epoch, index = divmod(batch, self.per_epoch)
            order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + epoch))
            yield order[index * self.batch_size : (index + 1) * self.batch_size][self.local].tolist()
            batch += 1


def collate_rows(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """A list of row dicts → a dict of columns (lists), the form reward functions take as keyword arguments."""
    return {key: [row[key] for row in rows] for key in rows[0]}


class RLVRDataModule(LightningDataModule):
    """Base: subclasses say where the train and evaluation prompts come from."""

    def __init__(self, batch_size: int = 8, eval_batch_size: int = 64, seed: int = 0) -> None:
        """batch_size: prompts per optimizer step over all processes (each rank takes an equal share)."""
        super().__init__()
        if batch_size < 1 or eval_batch_size < 1:
            raise ValueError("data.batch_size and data.eval_batch_size must be positive")
        self.batch_size, self.eval_batch_size, self.seed = batch_size, eval_batch_size, seed
        self.train_set: Dataset | None = None
        self.eval_sets: dict[str, Dataset] = {}

    def make_train_set(self) -> Dataset:
        raise NotImplementedError

    def make_eval_set(self, stage: str) -> Dataset | None:
        raise NotImplementedError

    def setup(self, stage: str) -> None:
        if stage == "fit":
            self.train_set = self.make_train_set()
        for name in ("validate", "test") if stage == "fit" else (stage,):
            dataset = self.make_eval_set(name)
            if dataset is not None:
                self.eval_sets[name] = dataset

    def train_dataloader(self) -> DataLoader:
        # One batch is one optimizer step, so the global step is the index of the next batch.
        trainer = self.trainer
        start, rank, world = (trainer.global_step, trainer.global_rank, trainer.world_size) if trainer else (0, 0, 1)
        sampler = StepBatchSampler(len(self.train_set), self.batch_size, self.seed, start, rank, world)
        return DataLoader(self.train_set, batch_sampler=sampler, collate_fn=collate_rows)

    def _eval_loader(self, stage: str) -> DataLoader | list:
        if stage not in self.eval_sets:
            return []  # no evaluation set configured: Lightning skips the loop
        return DataLoader(self.eval_sets[stage], batch_size=self.eval_batch_size, collate_fn=collate_rows)

    def val_dataloader(self):
        return self._eval_loader("validate")

    def test_dataloader(self):
        return self._eval_loader("test")


class ArithDataModule(RLVRDataModule):
    """The embedded task: 2-digit additions, answers reversed; fixed train/eval splits (eval for validate and test)."""

    def __init__(self, batch_size: int = 8, eval_batch_size: int = 100, seed: int = 0, eval_limit: int | None = None):
        super().__init__(batch_size, eval_batch_size, seed)
        self.eval_limit = eval_limit

    def make_train_set(self) -> Dataset:
        return ArithPrompts("train")

    def make_eval_set(self, stage: str) -> Dataset:
        dataset = ArithPrompts("eval")
        if self.eval_limit is not None:
            dataset.examples = dataset.examples[: self.eval_limit]
        return dataset


class PromptDataModule(RLVRDataModule):
    """Prompts from local JSONL/JSON/Parquet files or HF datasets, with a column mapping or a format preset."""

    def __init__(
        self,
        train: str,
        val: str | None = None,
        test: str | None = None,
        preset: Literal["dapo_math", "math500"] | None = None,
        eval_preset: Literal["dapo_math", "math500"] | None = None,
        prompt_key: str | None = None,
        answer_key: str | None = None,
        template: str | None = None,
        split: str = "train",
        eval_split: str = "test",
        limit: int | None = None,
        eval_limit: int | None = None,
        batch_size: int = 8,
        eval_batch_size: int = 64,
        seed: int = 0,
    ) -> None:
        super().__init__(batch_size, eval_batch_size, seed)
        # Fail at start-up, not after minutes of model loading, when a local file is missing.
        for key, path in (("data.train", train), ("data.val", val), ("data.test", test)):
            if path is not None and Path(path).suffix.lower() in (".jsonl", ".json", ".parquet"):
                if not Path(path).is_file():
                    raise FileNotFoundError(f"{key}: no such file {path!r}; give the path of a JSONL/JSON/Parquet file")
        self.paths = {"validate": val, "test": test}
        self.train, self.preset, self.eval_preset = train, preset, eval_preset
        self.prompt_key, self.answer_key, self.template = prompt_key, answer_key, template
        self.split, self.eval_split, self.limit, self.eval_limit = split, eval_split, limit, eval_limit

    def make_train_set(self) -> Dataset:
        return PromptDataset(self.train, self.prompt_key, self.answer_key, self.split, self.template, self.limit,
                             self.preset)

    def make_eval_set(self, stage: str) -> Dataset | None:
        path = self.paths[stage]
        if path is None:
            return None
        # Evaluation sets (MATH-500, ...) have their own columns: only the preset and the template carry over.
        return PromptDataset(path, split=self.eval_split, template=self.template, limit=self.eval_limit,
                             preset=self.eval_preset)
