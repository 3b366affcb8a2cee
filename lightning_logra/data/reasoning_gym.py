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
import signal
import threading
import time
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, Literal, Union

from torch.utils.data import Dataset

from lightning_logra.base.hashing import stable_seed
from lightning_logra.base.settings import check_positive, is_number
from lightning_logra.base.waits import waiting_for
from lightning_logra.data.module import OverlongPolicy, RLVRDataModule

log = logging.getLogger(__name__)

DEFAULT_INSTRUCTION = "Give only the final answer, inside <answer></answer> tags."
DEFAULT_PREFIX = "<answer>"
_MADE_BY_US = ("seed", "size")  # a generator's settings the data module sets itself
# How long one item may take. Every generator makes one at its default settings in under a second (futoshiki, the
# slowest, about 0.8 s); settings that take longer (5000-digit operands: a divisor search that never ends) would take
# far longer for data.size items.
DRAW_TIMEOUT_S = 60.0
_CULPRIT_TIMEOUT_S = 5.0  # each retry without one setting, looking for the one that makes no item
_FIRST_ITEMS = 8  # made of each task when the data module is built: enough to meet most of a generator's branches


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


def task_from(value: Any, key: str) -> ReasoningTask:
    """One entry of data.tasks (a mapping of name, weight and settings, or a ReasoningTask) as a ReasoningTask."""
    if isinstance(value, ReasoningTask):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"{key} must be a mapping such as {{name: gcd, weight: 1, settings: {{}}}}, got {value!r}")
    unknown = [name for name in value if name not in ("name", "weight", "settings")]
    if unknown:
        raise ValueError(f"{key}: unknown key {unknown[0]!r}; a task has name, weight and settings")
    if "name" not in value:
        raise ValueError(f"{key}: no name: give the reasoning-gym task's name ({{name: basic_arithmetic}})")
    settings = value.get("settings") or {}
    if not isinstance(settings, Mapping):
        raise ValueError(f"{key}.settings must be a mapping of the generator's settings ({{max_digits: 2}}), got "
                         f"{settings!r}")
    return ReasoningTask(value["name"], value.get("weight", 1.0), dict(settings))


def _fits(value: Any, hint: Any) -> bool:
    """Whether `value` fits the type annotation `hint` of a generator's setting (a list for a tuple: YAML has no
    tuples). An annotation this does not know lets anything through: the generator's own checks follow."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is type(None):
        return value is None
    if origin is Literal:
        return any(value == choice and type(value) is type(choice) for choice in args)
    if origin in (Union, types.UnionType):
        return any(_fits(value, choice) for choice in args)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin in (list, tuple, Sequence):
        if not isinstance(value, (list, tuple)):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:  # tuple[int, int]: one of each
            return len(value) == len(args) and all(_fits(item, kind) for item, kind in zip(value, args))
        return not args or all(_fits(item, args[0]) for item in value)
    if origin is dict or hint is dict:
        return isinstance(value, Mapping)
    return True


def _described(hint: Any) -> str:
    """What a setting annotated `hint` takes, in words of the config file."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return f"one of {', '.join(repr(choice) for choice in args)}"
    if origin in (Union, types.UnionType):
        return " or ".join("null" if choice is type(None) else _described(choice) for choice in args)
    if origin in (list, tuple, Sequence):
        return f"a list of {_described(args[0])}" if args else "a list"
    words = {bool: "true or false", int: "a whole number", float: "a number", str: "text", dict: "a mapping"}
    return words.get(hint, str(hint).replace("typing.", ""))


def _setting_types(config_class: type) -> dict[str, Any]:
    """The annotations of a generator's settings that its own defaults fit (some do not: `diff_ub: int = 0.2`,
    `variables: tuple[str] = ("x", "y", "z")`; those are left to the generator's checks). A default of None
    takes None."""
    try:
        hints = typing.get_type_hints(config_class)
    except Exception:  # an annotation that does not resolve: the generator's own checks are all there is
        return {}
    kinds = {}
    for f in fields(config_class):
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        if f.name not in hints or default is MISSING:
            continue
        if default is None or _fits(default, hints[f.name]):
            kinds[f.name] = hints[f.name] | None if default is None else hints[f.name]
    return kinds


def check_tasks(tasks: list[ReasoningTask]) -> None:
    """Every task names a generator, with a positive weight and settings its generator takes (of the types it
    annotates, and that it accepts): checked before anything is generated, each error naming its key
    (`data.tasks[1].settings.max_digits`)."""
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
        kinds = _setting_types(config_class)
        for setting, value in task.settings.items():
            if setting in _MADE_BY_US:
                raise ValueError(f"{key}.settings.{setting}: the data module sets it (data.seed, data.size and "
                                 "data.eval_size); leave it out of the task's settings")
            if setting not in known:
                raise ValueError(f"{key}.settings.{setting}: {task.name} has no such setting; its settings are "
                                 f"{', '.join(known)}")
            if setting in kinds and not _fits(value, kinds[setting]):
                # 2.5 digits passed the generator's own checks and failed at its first item
                raise ValueError(f"{key}.settings.{setting}: {task.name} takes {_described(kinds[setting])}, got "
                                 f"{value!r}")
        try:
            config = config_class(**task.settings)
            if hasattr(config, "validate"):
                config.validate()
        except Exception as error:  # the generators check their settings with asserts and ValueErrors of their own
            raise ValueError(f"{key}.settings: {task.name} refuses {task.settings}: {type(error).__name__}: "
                             f"{error or 'a setting is out of its range'}") from error
    # Each weight is finite, but their sum need not be: the shares were then NaN ("cannot convert float NaN").
    total = sum(task.weight for task in tasks)
    if not math.isfinite(total):
        raise ValueError(f"data.tasks[*].weight: the weights add up to {total} (over the largest number there is): "
                         "they are relative shares, so give them on a smaller scale (1 and 3 rather than 1e308 and "
                         "3e308)")


class _TooSlow(BaseException):
    """An item took longer than it was given. Not an Exception: a generator's own `except Exception` (or bare
    `except:`, as quantum_lock's search has around its arithmetic) must not take it for one of its errors."""


_REARM_S = 1.0  # after the time is up, the timer fires again this often: a generator that swallowed it is stopped later


@contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Raise _TooSlow in the code inside if it runs past `seconds` (a timer signal; in the main thread only, where
    signals are delivered: elsewhere, no limit), and again every _REARM_S after, should the code swallow it. The
    timer is cancelled and the handler before put back however the code ends; a timer set before is put back too,
    less the time taken here."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return
    armed = [True]

    def expired(signum, frame):
        if armed[0]:
            raise _TooSlow

    started = time.monotonic()
    previous = signal.signal(signal.SIGALRM, expired)
    outer, interval = signal.setitimer(signal.ITIMER_REAL, seconds, _REARM_S)
    try:
        yield
    finally:
        # Disarmed first: once the flag is down no alarm raises. One that fires before it is (the code inside ended
        # just as the time was up) is caught here, and the next is _REARM_S away.
        try:
            armed[0] = False
        except _TooSlow:
            armed[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer > 0:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - started), 1e-3), interval)


def shares(tasks: list[ReasoningTask], size: int) -> list[int]:
    """`size` items shared among the tasks in proportion to their weights (largest remainder: the counts add up to
    `size` exactly, and differ from the exact shares by less than one)."""
    total = sum(task.weight for task in tasks)
    exact = [size * (task.weight / total) for task in tasks]  # size · weight could overflow where the ratio does not
    counts = [math.floor(share) for share in exact]
    by_remainder = sorted(range(len(tasks)), key=lambda i: (counts[i] - exact[i], i))
    for i in by_remainder[: size - sum(counts)]:
        counts[i] += 1
    return counts


def generate(task: ReasoningTask, count: int, seed: int, key: str = "data.tasks") -> list[dict[str, Any]]:
    """`count` items of `task`, a pure function of (its settings, `seed`). Settings that every check passes can still
    make no item (words of 60 to 70 letters, where there are none) or take forever (5000-digit operands: a divisor
    search to the square root of one, or an answer too long to write as text): an item that fails, or takes over
    DRAW_TIMEOUT_S, is an error naming `key` (data.tasks[i]) and the setting without which it is made, where one is."""
    import reasoning_gym

    items: list[dict[str, Any]] = []
    try:
        dataset = reasoning_gym.create_dataset(task.name, size=count, seed=seed, **task.settings)
        for index in range(count):
            with _time_limit(DRAW_TIMEOUT_S):
                items.append(dataset[index])
    except (Exception, _TooSlow) as error:  # the generators raise whatever their code meets
        raise _no_item(task, seed, len(items), key, error) from error
    return items


def _no_item(task: ReasoningTask, seed: int, index: int, key: str, error: BaseException) -> ValueError:
    """The error of item `index` of `task` failing with `error`, naming the setting without which it is made."""
    retry_s = min(DRAW_TIMEOUT_S, _CULPRIT_TIMEOUT_S)
    culprit = next((setting for setting in task.settings
                    if _makes(task.name, {k: v for k, v in task.settings.items() if k != setting}, seed, index,
                              retry_s)), None)
    where = f"{key}.settings{f'.{culprit}' if culprit else ''}"
    if isinstance(error, _TooSlow):
        return ValueError(f"{where}: {task.name} took over {DRAW_TIMEOUT_S:g} s for item {index} with "
                          f"{task.settings}: settings that slow would take far longer for data.size items; lower them")
    return ValueError(f"{where}: {task.name} cannot make item {index} with {task.settings}: {type(error).__name__}: "
                      f"{error}")


def _makes(name: str, settings: dict[str, Any], seed: int, index: int, seconds: float) -> bool:
    """Whether the generator `name` makes item `index` from `seed` with `settings` within `seconds`."""
    import reasoning_gym

    try:
        with _time_limit(seconds):
            reasoning_gym.create_dataset(name, size=index + 1, seed=seed, **settings)[index]
    except (Exception, _TooSlow):  # refused settings, or the same failure
        return False
    return True


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
            (each a `ReasoningTask`, or a mapping of its fields). A list of plain mappings to the command line: a
            `--data.init_args.tasks` list replaces the config file's, where jsonargparse merged a list of dataclasses
            into it entry by entry (a task given again kept its old settings and weight).
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
        tasks: list[dict[str, Any]],
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
        if not isinstance(tasks, Sequence) or isinstance(tasks, str):
            raise ValueError(f"data.tasks must be a list of tasks such as [{{name: basic_arithmetic}}], got {tasks!r}")
        tasks = [task_from(task, f"data.tasks[{index}]") for index, task in enumerate(tasks)]
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
        # The first items of each task, made now: settings that make none fail here, naming the key, rather than
        # at set-up (the items are made in `setup`, before the model's weights load)
        for index, task in enumerate(tasks):
            generate(task, _FIRST_ITEMS, stable_seed(seed, task.name, "train"), f"data.tasks[{index}]")
        self.tasks, self.size, self.eval_size = tasks, size, eval_size
        self.eval_seed = eval_seed
        self.format = dict(instruction=instruction, system_prompt=system_prompt, answer_prefix=answer_prefix,
                           chat_template=chat_template)
        self._train_items: list[tuple[str, dict[str, Any]]] | None = None
        self._eval_set: ReasoningGymPrompts | None = None  # validate's and test's

    def task_names(self) -> list[str]:
        return [task.name for task in self.tasks]

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "tasks": [asdict(task) for task in self.tasks], "size": self.size,
                "eval_size": self.eval_size, "eval_seed": self.eval_seed, **self.format}

    def train_items(self) -> list[tuple[str, dict[str, Any]]]:
        """The training items, task by task (the loader's order is the sampler's): made once."""
        if self._train_items is None:
            with waiting_for(f"generating {self.size} training items of {len(self.tasks)} reasoning-gym tasks", log):
                self._train_items = [
                    (task.name, entry)
                    for index, (task, count) in enumerate(zip(self.tasks, shares(self.tasks, self.size)))
                    for entry in generate(task, count, stable_seed(self.seed, task.name, "train"),
                                          f"data.tasks[{index}]")]
        return self._train_items

    def eval_items(self) -> list[tuple[str, dict[str, Any]]]:
        """`eval_size` items of each task from the evaluation seed, less those whose question is a training one."""
        seed = self.eval_seed if self.eval_seed is not None else stable_seed(self.seed, "eval")
        seen = {entry["question"] for _, entry in self.train_items()}
        items = []
        for index, task in enumerate(self.tasks):
            made = generate(task, self.eval_size, stable_seed(seed, task.name, "eval"), f"data.tasks[{index}]")
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
