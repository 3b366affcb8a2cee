"""reasoning-gym's procedural tasks as a data module: a weighted mix of tasks, each with its generator's settings,
made into prompts with the columns `rewards.ReasoningGymScore` scores them by.

reasoning-gym (the `reasoning` extra; Apache-2.0) has about a hundred generators (arithmetic, strings, counting,
logic, puzzles, ...), each a deterministic function of (its settings, a seed, an index) with a scorer of its own, and
needs nothing downloaded. The training set is `size` items, shared among the tasks by their weights; the held-out
evaluation set (validate and test) is `eval_size` items of each task, from seeds of their own, less any whose
question is also in the training set. Each row holds:

- `prompt`: the task's question followed by `instruction`, as the one user message of a conversation (after a
  `system_prompt` if one is given), which the model's chat template renders; with `answer_prefix`, the assistant's
  turn is begun with it (a last assistant message that generation continues, as TRL continues one). With
  `chat_template: false`, the same as plain text;
- `answer`: the item's reference answer (text), for a reader (the reward scores with `entry`);
- `task`: the task's name: the module logs `reward/<task>/mean` every step and every evaluation metric per task
  (`val/<task>/pass@k`);
- `entry`: the item as reasoning-gym made it (question, answer, metadata), which the task's scorer reads.
"""

from __future__ import annotations

import difflib
import logging
import math
from dataclasses import dataclass, field, fields
from typing import Any

from torch.utils.data import Dataset

from lightning_logra.base.hashing import stable_seed
from lightning_logra.base.settings import check_positive, is_number
from lightning_logra.base.waits import waiting_for
from lightning_logra.data.module import OverlongPolicy, RLVRDataModule

log = logging.getLogger(__name__)

DEFAULT_INSTRUCTION = "Give only the final answer, inside <answer></answer> tags."
DEFAULT_PREFIX = "<answer>"
_MADE_BY_US = ("seed", "size")  # a generator's settings the data module sets itself


@dataclass
class ReasoningTask:
    """One task of the mix.

    Args:
        name: a reasoning-gym dataset name (`basic_arithmetic`, `spell_backward`, ...).
        weight: its share of the training set, relative to the other tasks' weights.
        settings: the generator's own settings (the fields of its config dataclass, such as `min_terms`,
            `max_digits`), every other one at its default. `seed` and `size` are the data module's.
    """

    name: str
    weight: float = 1.0
    settings: dict[str, Any] = field(default_factory=dict)


def _registry() -> dict[str, tuple[type, type]]:
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise ImportError("the reasoning-gym tasks need reasoning-gym: pip install 'lightning-logra[reasoning]'"
                          ) from None
    return {name: classes for name, classes in DATASETS.items() if name != "composite"}


def check_tasks(tasks: list[ReasoningTask]) -> None:
    """Every task names a generator, with a positive weight and settings its generator takes (and accepts): checked
    before anything is generated, each error naming its key (`data.tasks[1].settings.max_digits`)."""
    if not tasks:
        raise ValueError("data.tasks is empty: give at least one reasoning-gym task, e.g. [{name: basic_arithmetic}]")
    registry = _registry()
    seen: set[str] = set()
    for index, task in enumerate(tasks):
        key = f"data.tasks[{index}]"
        if task.name not in registry:
            close = difflib.get_close_matches(str(task.name), registry, n=3, cutoff=0.6)
            hint = f" (did you mean {' or '.join(close)}?)" if close else ""
            raise ValueError(f"{key}.name: {task.name!r} is not a reasoning-gym task{hint}; the tasks are "
                             f"{', '.join(sorted(registry))}")
        if task.name in seen:
            raise ValueError(f"{key}.name: {task.name!r} is in data.tasks twice; give each task once, with its weight")
        seen.add(task.name)
        check_positive(f"{key}.weight", task.weight, "number (a share of data.size)")
        config_class = registry[task.name][1]
        known = [f.name for f in fields(config_class) if f.name not in _MADE_BY_US]
        for setting in task.settings:
            if setting in _MADE_BY_US:
                raise ValueError(f"{key}.settings.{setting}: the data module sets it (data.seed, data.size and "
                                 "data.eval_size); leave it out of the task's settings")
            if setting not in known:
                raise ValueError(f"{key}.settings.{setting}: {task.name} has no such setting; its settings are "
                                 f"{', '.join(known)}")
        try:
            config = config_class(**task.settings)
            if hasattr(config, "validate"):
                config.validate()
        except Exception as error:  # the generators check their settings with asserts and ValueErrors of their own
            raise ValueError(f"{key}.settings: {task.name} refuses {task.settings}: {type(error).__name__}: "
                             f"{error or 'a setting is out of its range'}") from error


def shares(tasks: list[ReasoningTask], size: int) -> list[int]:
    """`size` items shared among the tasks in proportion to their weights (largest remainder: the counts add up to
    `size` exactly, and differ from the exact shares by less than one)."""
    total = sum(task.weight for task in tasks)
    exact = [size * task.weight / total for task in tasks]
    counts = [math.floor(share) for share in exact]
    by_remainder = sorted(range(len(tasks)), key=lambda i: (counts[i] - exact[i], i))
    for i in by_remainder[: size - sum(counts)]:
        counts[i] += 1
    return counts


def generate(task: ReasoningTask, count: int, seed: int) -> list[dict[str, Any]]:
    """`count` items of `task`, a pure function of (its settings, `seed`)."""
    import reasoning_gym

    dataset = reasoning_gym.create_dataset(task.name, size=count, seed=seed, **task.settings)
    return [dataset[index] for index in range(count)]


class ReasoningGymPrompts(Dataset):
    """Items of reasoning-gym tasks as prompt rows (`prompt`, `answer`, `task`, `entry`); see the module's doc."""

    def __init__(self, items: list[tuple[str, dict[str, Any]]], instruction: str, system_prompt: str | None,
                 answer_prefix: str | None, chat_template: bool) -> None:
        self.items = items  # (task name, reasoning-gym entry)
        self.instruction, self.system_prompt = instruction, system_prompt
        self.answer_prefix, self.chat_template = answer_prefix, chat_template

    def prompt(self, question: str) -> str | list[dict[str, str]]:
        text = f"{question.rstrip()}\n\n{self.instruction}" if self.instruction else question
        if not self.chat_template:
            system = f"{self.system_prompt}\n\n" if self.system_prompt else ""
            return f"{system}{text}\n{self.answer_prefix or ''}"
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages.append({"role": "user", "content": text})
        if self.answer_prefix:
            messages.append({"role": "assistant", "content": self.answer_prefix})
        return messages

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, Any]:
        task, entry = self.items[index]
        return {"prompt": self.prompt(entry["question"]), "answer": str(entry["answer"]), "task": task,
                "entry": entry}


class ReasoningGymDataModule(RLVRDataModule):
    """A weighted mix of reasoning-gym tasks: prompts generated from seeds, scored by each task's own scorer
    (`model.reward: lightning_logra.rewards.ReasoningGymScore`).

    Args:
        tasks: the mix: `[{name: basic_arithmetic, weight: 2, settings: {max_digits: 2}}, {name: spell_backward}]`
            (`ReasoningTask`).
        size: training items over all tasks, shared by weight.
        eval_size: held-out items of each task (validate and test), fewer where one repeats a training question.
        eval_seed: the evaluation items' seed (None: one derived from `seed`, apart from the training items').
        instruction: added after each question (a blank line between): how to give the answer, which the reward
            reads. The default asks for it inside <answer></answer> tags.
        answer_prefix: what the assistant's turn begins with, in the prompt (None: nothing): with the default,
            `<answer>`, the completion is the answer itself, closed by `</answer>` or the stop token.
        system_prompt: a system message before the question (None: the chat template's default, if it has one).
        chat_template: prompts as conversations for the model's chat template (the default; an instruct model's);
            False: as plain text.
        batch_size, eval_batch_size, seed, max_prompt_length, overlong_prompts: as every data module's; `seed` also
            seeds the items.
    """

    def __init__(
        self,
        tasks: list[ReasoningTask],
        size: int = 1000,
        eval_size: int = 50,
        eval_seed: int | None = None,
        instruction: str = DEFAULT_INSTRUCTION,
        answer_prefix: str | None = DEFAULT_PREFIX,
        system_prompt: str | None = None,
        chat_template: bool = True,
        batch_size: int = 8,
        eval_batch_size: int = 64,
        seed: int = 0,
        max_prompt_length: int | None = None,
        overlong_prompts: OverlongPolicy = "drop",
    ) -> None:
        super().__init__(batch_size, eval_batch_size, seed, max_prompt_length, overlong_prompts)
        tasks = [task if isinstance(task, ReasoningTask) else ReasoningTask(**task) for task in tasks]
        check_tasks(tasks)
        check_positive("data.size", size, "number of items", integer=True)
        check_positive("data.eval_size", eval_size, "number of items per task", integer=True)
        if eval_seed is not None and not is_number(eval_seed, integer=True):
            raise ValueError(f"data.eval_seed must be a whole number (or null: derived from data.seed), got "
                             f"{eval_seed!r}")
        empty = [i for i, count in enumerate(shares(tasks, size)) if count == 0]
        if empty:
            raise ValueError(f"data.size={size} shared by weight gives data.tasks[{empty[0]}] ({tasks[empty[0]].name}, "
                             f"weight {tasks[empty[0]].weight:g}) no items: raise data.size or that task's weight")
        self.tasks, self.size, self.eval_size = tasks, size, eval_size
        self.eval_seed = eval_seed
        self.format = dict(instruction=instruction, system_prompt=system_prompt, answer_prefix=answer_prefix,
                           chat_template=chat_template)
        self._train_items: list[tuple[str, dict[str, Any]]] | None = None
        self._eval_set: ReasoningGymPrompts | None = None  # validate's and test's

    def task_names(self) -> list[str]:
        return [task.name for task in self.tasks]

    def train_items(self) -> list[tuple[str, dict[str, Any]]]:
        """The training items, task by task (the loader's order is the sampler's): made once."""
        if self._train_items is None:
            with waiting_for(f"generating {self.size} training items of {len(self.tasks)} reasoning-gym tasks", log):
                self._train_items = [
                    (task.name, entry) for task, count in zip(self.tasks, shares(self.tasks, self.size))
                    for entry in generate(task, count, stable_seed(self.seed, task.name, "train"))]
        return self._train_items

    def eval_items(self) -> list[tuple[str, dict[str, Any]]]:
        """`eval_size` items of each task from the evaluation seed, less those whose question is a training one."""
        seed = self.eval_seed if self.eval_seed is not None else stable_seed(self.seed, "eval")
        seen = {entry["question"] for _, entry in self.train_items()}
        items = []
        for task in self.tasks:
            made = generate(task, self.eval_size, stable_seed(seed, task.name, "eval"))
            kept = [entry for entry in made if entry["question"] not in seen]
            if len(kept) < len(made):
                log.warning("data: %d of the %d evaluation items of %s repeat a training question and are left out "
                            "(its settings allow few distinct questions)", len(made) - len(kept), len(made), task.name)
            if not kept:
                raise ValueError(f"data.tasks: every evaluation item of {task.name} is also a training question: "
                                 "its settings allow too few distinct questions; widen them, or lower data.size")
            items += [(task.name, entry) for entry in kept]
        return items

    def make_train_set(self) -> Dataset:
        return ReasoningGymPrompts(self.train_items(), **self.format)

    def make_eval_set(self, stage: str) -> Dataset:
        if self._eval_set is None:
            self._eval_set = ReasoningGymPrompts(self.eval_items(), **self.format)
        return self._eval_set
