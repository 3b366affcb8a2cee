"""Lightning DataModules for RLVR: batches of prompt rows, one batch per optimizer step.

The training stream is a pure function of (seed, step): batch b is a slice of the permutation of epoch
b // batches_per_epoch, drawn from a generator seeded with seed + epoch. The loader starts at the trainer's
global step, so a resumed run sees exactly the prompts an uninterrupted run would have seen.

In a Trainer with an RLVRModule, each prompt is tokenized once, when its loader is made, by the model's own
`encode_prompts` (what the rollout engine receives, chat template included); prompts of no tokens are dropped there,
prompts over `max_prompt_length` (unset: what the model's context leaves beside the completions) are dropped or keep
their last tokens, and the batches carry the token ids.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset, Sampler

from lightning_logra.base.hashing import stable_seed
from lightning_logra.base.settings import check_positive
from lightning_logra.data.add3 import Add3Prompts
from lightning_logra.data.arith import ArithPrompts
from lightning_logra.data.prompts import LOCAL_FORMATS, DatasetSource, PromptDataset
from lightning_logra.data.tool_task import ToolPrompts
from lightning_logra.train.checkpoint import changed_settings

log = logging.getLogger(__name__)

OverlongPolicy = Literal["drop", "truncate"]
STAGE_KEYS = {"fit": "data.train", "validate": "data.val", "test": "data.test"}  # whose set each stage reads
_ENCODE_BATCH = 1024  # prompts tokenized at a time when loaders are made
_EXTRA_STREAM = 0x6479  # salts the extra prompts' stream apart from every other seed of (seed, step, round)


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
            raise ValueError(f"data.batch_size={batch_size} (the global batch) must be divisible by the {world_size} "
                             "processes")
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


def plain(value: Any) -> Any:
    """`value` as plain data, as a checkpoint holds it and a resume compares it: dicts, lists (a tuple becomes one),
    text, numbers, bools and None; a dataclass as a dict of its fields; anything else as its repr."""
    if is_dataclass(value) and not isinstance(value, type):
        value = asdict(value)
    if isinstance(value, dict):
        return {str(key): plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return repr(value)


def collate_rows(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """A list of row dicts → a dict of columns (lists), the form reward functions take as keyword arguments."""
    return {key: [row[key] for row in rows] for key in rows[0]}


class TokenizedPrompts(Dataset):
    """The rows of `dataset` at `indices`, each with its prompt's token ids under "prompt_ids" (the rollout engine's
    input, used instead of tokenizing the prompt again)."""

    def __init__(self, dataset: Dataset, indices: list[int], ids: list[torch.Tensor]) -> None:
        self.dataset, self.indices = dataset, indices
        # One flat tensor and offsets rather than a Python list per prompt: 17k prompts of 300 tokens held as Python
        # ints would take about 200 MB.
        self.offsets = torch.tensor([0, *(len(row) for row in ids)]).cumsum(0)
        self.ids = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int64)

    def prompt_ids(self, index: int) -> list[int]:
        return self.ids[self.offsets[index] : self.offsets[index + 1]].tolist()

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {**self.dataset[self.indices[index]], "prompt_ids": self.prompt_ids(index)}

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        wanted = [self.indices[i] for i in indices]
        if hasattr(self.dataset, "__getitems__"):
            rows = self.dataset.__getitems__(wanted)  # one Arrow read for a PromptDataset
        else:
            rows = [self.dataset[i] for i in wanted]
        return [{**row, "prompt_ids": self.prompt_ids(i)} for row, i in zip(rows, indices)]


def limit_prompt_length(dataset: Dataset, encode: Callable[[list[Any]], list[list[int]]],
                        max_prompt_length: int | None, overlong_prompts: OverlongPolicy, where: str,
                        origin: str | None = None) -> TokenizedPrompts:
    """Every prompt of `dataset` tokenized once by `encode`. Prompts of no tokens are dropped (nothing to answer);
    those longer than `max_prompt_length` tokens (None: no limit) are dropped ("drop") or cut to their last
    `max_prompt_length` tokens ("truncate": the end of a prompt, where the question and the generation prompt are, is
    what the model answers). `origin` says where a limit other than data.max_prompt_length came from (the model's
    context). Logs how many, naming `where`."""
    limit = f"data.max_prompt_length={max_prompt_length} tokens" if origin is None else (
        f"{max_prompt_length} tokens (the model's context: {origin}; data.max_prompt_length is unset)")
    kept: list[int] = []
    ids: list[torch.Tensor] = []
    empty, too_long, shortest = 0, 0, None
    batches = DataLoader(dataset, batch_size=_ENCODE_BATCH, collate_fn=collate_rows)
    for index, row in enumerate(row for batch in batches for row in encode(batch["prompt"])):
        if not row:
            empty += 1
            continue
        shortest = len(row) if shortest is None else min(shortest, len(row))
        if max_prompt_length is not None and len(row) > max_prompt_length:
            too_long += 1
            if overlong_prompts == "drop":
                continue
            row = row[-max_prompt_length:]
        kept.append(index)
        ids.append(torch.tensor(row, dtype=torch.int64))
    if shortest is None:
        raise ValueError(f"{where}: every prompt tokenizes to no tokens at all; check the prompts and the model's "
                         "tokenizer")
    if not kept:
        fix = ("raise data.max_prompt_length" if origin is None
               else "leave the prompts more of the context (fewer new tokens, or a model with a longer context)")
        raise ValueError(f"{where}: every prompt is longer than {limit} (the shortest has {shortest}); {fix}, or set "
                         "data.overlong_prompts: truncate")
    if empty:
        log.warning("%s: %d of %d prompts tokenize to no tokens at all and were dropped", where, empty, len(dataset))
    if too_long and overlong_prompts == "drop":
        log.warning("%s: %d of %d prompts are longer than %s and were dropped, %d left (data.overlong_prompts: "
                    "truncate keeps their last tokens instead)", where, too_long, len(dataset), limit, len(kept))
    elif too_long:
        log.warning("%s: %d of %d prompts are longer than %s and keep only their last %d (data.overlong_prompts: "
                    "drop leaves them out instead)", where, too_long, len(dataset), limit, max_prompt_length)
    return TokenizedPrompts(dataset, kept, ids)


class RLVRDataModule(LightningDataModule):
    """Base: subclasses say where the train and evaluation prompts come from."""

    def __init__(self, batch_size: int = 8, eval_batch_size: int = 64, seed: int = 0,
                 max_prompt_length: int | None = None, overlong_prompts: OverlongPolicy = "drop") -> None:
        """batch_size: prompts per optimizer step over all processes (each rank takes an equal share).
        max_prompt_length, overlong_prompts: see `PromptDataModule`."""
        super().__init__()
        check_positive("data.batch_size", batch_size, "number of prompts", integer=True)
        check_positive("data.eval_batch_size", eval_batch_size, "number of prompts", integer=True)
        check_positive("data.max_prompt_length", max_prompt_length, "number of tokens", integer=True,
                       null="what the model's context leaves")
        if overlong_prompts not in ("drop", "truncate"):
            raise ValueError(f"data.overlong_prompts must be 'drop' or 'truncate', got {overlong_prompts!r}")
        self.batch_size, self.eval_batch_size, self.seed = batch_size, eval_batch_size, seed
        self.max_prompt_length, self.overlong_prompts = max_prompt_length, overlong_prompts
        self.train_set: Dataset | None = None
        self.eval_sets: dict[str, Dataset] = {}
        self._within_length: dict[str, Dataset] = {}  # per stage, the sets after max_prompt_length (made once)

    def make_train_set(self) -> Dataset:
        raise NotImplementedError

    def make_eval_set(self, stage: str) -> Dataset | None:
        raise NotImplementedError

    def settings(self) -> dict[str, Any]:
        """What makes its prompts and their order, by key under `data.` (a subclass adds its own): a checkpoint records
        them, and a resume under others says which changed."""
        return {"batch_size": self.batch_size, "eval_batch_size": self.eval_batch_size, "seed": self.seed,
                "max_prompt_length": self.max_prompt_length, "overlong_prompts": self.overlong_prompts}

    def state_dict(self) -> dict[str, Any]:
        # Lightning saves it in every checkpoint, under the class's name, and hands it back to load_state_dict on a
        # resume. Plain data only: a checkpoint's load builds nothing else (train/safe_load.py).
        return {"settings": plain(self.settings())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # This run's settings apply, as the module's do (train/checkpoint.py): say where they differ, since the
        # prompts from here on are then not those the checkpoint's run would have drawn.
        recorded = state_dict.get("settings", {})
        for key, (before, now) in changed_settings(recorded, plain(self.settings())).items():
            log.warning("data.%s: the checkpoint was made with %r, this run uses %r", key, before, now)

    def task_names(self) -> list[str]:
        """The tasks its rows belong to, each row naming its own in a `task` column: the module then logs the reward
        and the evaluation metrics per task (`train.task_metrics`). Empty here: one task."""
        return []

    def setup(self, stage: str) -> None:
        if stage == "fit":
            self.train_set = self.make_train_set()
        for name in ("validate", "test") if stage == "fit" else (stage,):
            dataset = self.make_eval_set(name)
            if dataset is not None:
                self.eval_sets[name] = dataset

    def _within_prompt_length(self, dataset: Dataset, stage: str) -> Dataset:
        """`dataset` tokenized, with empty prompts dropped and max_prompt_length applied (unset: the room the model's
        context leaves beside `stage`'s completions), made when the first loader of `stage` is: the tokenizer is the
        model's, loaded after `setup`."""
        if stage not in self._within_length:
            module = self.trainer.lightning_module if self.trainer is not None else None
            if not hasattr(module, "encode_prompts"):
                if self.max_prompt_length is None:
                    return dataset  # used on its own: no model to count tokens with, and no limit asked for
                raise ValueError("data.max_prompt_length counts tokens with the model's encode_prompts: run the data "
                                 "module in a Trainer with an RLVRModule, or set data.max_prompt_length: null")
            # Without a limit of its own, a prompt past the model's context would still reach generation, whose
            # memory then grows without bound (a 6k-token prompt took a 32-position model's run to 19 GB); a limit
            # set past it would let the same prompts through.
            limit, origin = self.max_prompt_length, None
            if limit is None:
                limit, origin = module.prompt_token_limit(stage) or (None, None)
            else:
                # Fitting checks the evaluation's room too: its longer completions would fail the first validation.
                for checked in (stage, *self.eval_sets) if stage == "fit" else (stage,):
                    self._check_max_prompt_length(module.prompt_token_limit(checked))
            self._within_length[stage] = limit_prompt_length(dataset, module.encode_prompts, limit,
                                                             self.overlong_prompts, STAGE_KEYS[stage], origin)
        return self._within_length[stage]

    def _check_max_prompt_length(self, context: tuple[int, str] | None) -> None:
        """Refuse a data.max_prompt_length longer than `context`, the room the model's context leaves for a prompt
        beside a stage's completions, and where it comes from (None: a model without a fixed context)."""
        if context is not None and self.max_prompt_length > context[0]:
            room, origin = context
            raise ValueError(f"data.max_prompt_length={self.max_prompt_length} is longer than the {room} tokens the "
                             f"model's context leaves for a prompt ({origin}): set data.max_prompt_length to {room} or "
                             "less, or leave it unset for that limit")

    def train_dataloader(self) -> DataLoader:
        # One batch is one optimizer step, so the global step is the index of the next batch.
        trainer = self.trainer
        start, rank, world = (trainer.global_step, trainer.global_rank, trainer.world_size) if trainer else (0, 0, 1)
        dataset = self._within_prompt_length(self.train_set, "fit")
        sampler = StepBatchSampler(len(dataset), self.batch_size, self.seed, start, rank, world)
        return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_rows)

    def extra_batch(self, step: int, round: int) -> dict[str, list[Any]]:
        """Round `round` (≥ 1) of step `step`'s dynamic sampling (`model.rollouts.dynamic_sampling`): data.batch_size
        more prompts, this rank's share of them, drawn from the training set by a stream of their own that depends on
        (seed, step, round) alone. A resumed run draws what the uninterrupted one did, and the loader's batches stay
        what they would be without dynamic sampling (an extra prompt may be one the loader gives another step)."""
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer else (0, 1)
        dataset = self._within_prompt_length(self.train_set, "fit")
        generator = torch.Generator().manual_seed(stable_seed(self.seed, step, round, _EXTRA_STREAM))
        drawn = torch.randperm(len(dataset), generator=generator)[: self.batch_size]
        local = self.batch_size // world
        indices = drawn[rank * local : (rank + 1) * local].tolist()
        rows = dataset.__getitems__(indices) if hasattr(dataset, "__getitems__") else [dataset[i] for i in indices]
        return collate_rows(rows)

    def _eval_loader(self, stage: str) -> DataLoader | list:
        if stage not in self.eval_sets:
            return []  # no evaluation set configured: Lightning skips the loop
        dataset = self._within_prompt_length(self.eval_sets[stage], stage)
        return DataLoader(dataset, batch_size=self.eval_batch_size, collate_fn=collate_rows)

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

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "eval_limit": self.eval_limit}

    def _within_prompt_length(self, dataset: Dataset, stage: str) -> Dataset:
        # The embedded tasks' prompts are a few digits of one form, none empty, and their tokenizer has one token per
        # character: when the longest prompt fits the model's context, every one does, and the sets are not tokenized
        # prompt by prompt (add3's 807,946 took 30 s at every start). Only without a data.max_prompt_length (which
        # these modules do not take, but a subclass may): one is checked against the context, and holds the prompts,
        # in the base class's way.
        module = self.trainer.lightning_module if self.trainer is not None else None
        if self.max_prompt_length is None and hasattr(module, "prompt_token_limit"):
            limit = module.prompt_token_limit(stage)
            if limit is None or len(module.encode_prompts([dataset.longest_prompt()])[0]) <= limit[0]:
                return dataset
        return super()._within_prompt_length(dataset, stage)

    def make_eval_set(self, stage: str) -> Dataset:
        dataset = ArithPrompts("eval")
        if self.eval_limit is not None:
            dataset.examples = dataset.examples[: self.eval_limit]
        return dataset


class Add3DataModule(ArithDataModule):
    """The harder embedded task (`lightning_logra/data/add3.py`): 3-digit additions, answers reversed; 807,946 train
    pairs and a held-out split of 2,054 (validate and test; `eval_limit` keeps its first pairs)."""

    def make_train_set(self) -> Dataset:
        return Add3Prompts("train")

    def make_eval_set(self, stage: str) -> Dataset:
        return Add3Prompts("eval", self.eval_limit)


class ToolTaskDataModule(ArithDataModule):
    """The embedded multi-turn task (`lightning_logra/data/tool_task.py`): products of two 3-digit numbers, which the
    model gets right by calling a `multiply` tool; 808,007 train pairs and a held-out split of 1,993 (validate and
    test; `eval_limit` keeps its first pairs)."""

    def make_train_set(self) -> Dataset:
        return ToolPrompts("train")

    def make_eval_set(self, stage: str) -> Dataset:
        return ToolPrompts("eval", self.eval_limit)


class PromptDataModule(RLVRDataModule):
    """Prompts from the Hub or local files through `datasets.load_dataset`, with a column mapping or a format preset.

    Args:
        train, val, test: where each set comes from: a path (a hub id, a local folder, or a .jsonl/.json/.parquet/.csv
            file), or a `DatasetSource` with the arguments of `datasets.load_dataset`: `{path: openai/gsm8k, name:
            main}`, plus `data_files`, `revision`, `split`. val and test are optional.
        preset, eval_preset: the column mapping of a known format ("dapo_math", "math500") for the training set and
            for the evaluation sets. Without an eval_preset, the evaluation sets have the training set's columns.
        prompt_key, answer_key: the training set's columns (dotted paths reach nested values); they override the
            preset's.
        template: the prompt text with "{prompt}" where the row's prompt goes (in a conversation, the last user
            message), for every set.
        split, eval_split: the split read when a source names none (a single local file has one split, "train").
        limit, eval_limit: keep the first rows only.
        deduplicate: drop rows whose prompt repeats an earlier row's (the first stays, in order; the count is logged).
        max_prompt_length: the longest prompt, in tokens as the rollout engine receives them (chat template
            included); null: what the model's context leaves beside the completions (the engine's max_model_len
            when set, else the model's max_position_embeddings, less model.sampling.max_new_tokens for the training set
            and the evaluation's for val/test). Prompts are tokenized once, when the loaders are made; prompts of no
            tokens are dropped, with a count logged.
        overlong_prompts: what happens to a longer prompt: "drop" leaves it out of the set, "truncate" keeps its
            last max_prompt_length tokens. Either way the count is logged.
    """

    def __init__(
        self,
        train: str | DatasetSource,
        val: str | DatasetSource | None = None,
        test: str | DatasetSource | None = None,
        preset: Literal["dapo_math", "math500"] | None = None,
        eval_preset: Literal["dapo_math", "math500"] | None = None,
        prompt_key: str | None = None,
        answer_key: str | None = None,
        template: str | None = None,
        split: str = "train",
        eval_split: str = "test",
        limit: int | None = None,
        eval_limit: int | None = None,
        deduplicate: bool = True,
        max_prompt_length: int | None = None,
        overlong_prompts: OverlongPolicy = "drop",
        batch_size: int = 8,
        eval_batch_size: int = 64,
        seed: int = 0,
    ) -> None:
        super().__init__(batch_size, eval_batch_size, seed, max_prompt_length, overlong_prompts)
        self.sources = {stage: source if source is None or isinstance(source, DatasetSource) else DatasetSource(source)
                        for stage, source in (("fit", train), ("validate", val), ("test", test))}
        # Fail at start-up, not after minutes of model loading, when a local file is missing.
        for stage, source in self.sources.items():
            if source is not None and Path(source.path).suffix.lower() in LOCAL_FORMATS:
                if not Path(source.path).expanduser().is_file():
                    raise FileNotFoundError(f"{STAGE_KEYS[stage]}: no such file {source.path!r}; give the path of a "
                                            f"{'/'.join(sorted(LOCAL_FORMATS))} file")
        self.preset, self.eval_preset = preset, eval_preset
        self.prompt_key, self.answer_key, self.template = prompt_key, answer_key, template
        self.split, self.eval_split, self.limit, self.eval_limit = split, eval_split, limit, eval_limit
        self.deduplicate = deduplicate

    def settings(self) -> dict[str, Any]:
        sources = {key: self.sources[stage] for key, stage in (("train", "fit"), ("val", "validate"), ("test", "test"))}
        return {**super().settings(), **sources, "preset": self.preset, "eval_preset": self.eval_preset,
                "prompt_key": self.prompt_key, "answer_key": self.answer_key, "template": self.template,
                "split": self.split, "eval_split": self.eval_split, "limit": self.limit, "eval_limit": self.eval_limit,
                "deduplicate": self.deduplicate}

    def make_train_set(self) -> Dataset:
        return PromptDataset(self.sources["fit"], self.prompt_key, self.answer_key, self.split, self.template,
                             self.limit, self.preset, self.deduplicate, config_key=STAGE_KEYS["fit"])

    def make_eval_set(self, stage: str) -> Dataset | None:
        source = self.sources[stage]
        if source is None:
            return None
        # An evaluation set with a format of its own (MATH-500 beside DAPO-Math) names it in eval_preset; without
        # one it is another split of the training data, with the same columns.
        keys = (None, None, self.eval_preset) if self.eval_preset else (self.prompt_key, self.answer_key, self.preset)
        prompt_key, answer_key, preset = keys
        return PromptDataset(source, prompt_key, answer_key, self.eval_split, self.template, self.eval_limit, preset,
                             self.deduplicate, config_key=STAGE_KEYS[stage])
