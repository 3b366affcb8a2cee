"""Prompt datasets for RLVR: rows of ``{"prompt": str, "answer": str, ...}`` from local files or the HF Hub.

The trainer samples completions for ``prompt`` and hands ``answer`` (and every other column) to the reward
function. Prompts stay plain text: the trainer applies the tokenizer's chat template, so a chat-format row keeps
only its user message here.
"""

import json
import logging
from pathlib import Path
from typing import Any, Literal

from torch.utils.data import Dataset

from lightning_logra.waits import waiting_for

log = logging.getLogger(__name__)

# (prompt_key, answer_key) of the formats users know.
PRESETS: dict[str, tuple[str, str]] = {
    # BytedTsinghua-SIA/DAPO-Math-17k: "prompt" is a chat whose user message already asks for a final
    # "Answer: $Answer" line; the gold answer sits in "reward_model": {"ground_truth": ...}.
    "dapo_math": ("prompt", "reward_model.ground_truth"),
    # HuggingFaceH4/MATH-500: flat columns problem / solution / answer / subject / level / unique_id.
    "math500": ("problem", "answer"),
}

_LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")
_KEY_HINT = "dotted paths such as 'reward_model.ground_truth' reach nested values"


def _read_local(path: Path, limit: int | None) -> list[dict[str, Any]]:
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {path} (absolute: {path.resolve()})")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        # Imported here so that JSON files need no pyarrow.
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        return (table if limit is None else table.slice(0, limit)).to_pylist()
    with path.open(encoding="utf-8") as f:
        if suffix == ".json":
            rows = json.load(f)
            if not isinstance(rows, list):
                raise ValueError(f"{path}: expected a JSON list of objects, got a {type(rows).__name__}")
        else:
            rows = []
            for line_number, line in enumerate(f, start=1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as error:
                        raise ValueError(f"{path}:{line_number}: not valid JSON ({error})") from None
    return rows[:limit]


def _read_hub(name: str, split: str, limit: int | None) -> list[dict[str, Any]]:
    # Imported only here: local files need no `datasets`, whose import alone takes seconds.
    from datasets import load_dataset

    dataset = load_dataset(name, split=split)
    if limit is not None:
        dataset = dataset.select(range(min(limit, len(dataset))))
    return dataset.to_list()


def _lookup(row: dict[str, Any], key: str, key_arg: str, where: str) -> Any:
    """The value at ``key`` (dotted for nested mappings) in ``row``; a missing column names the key, where it was
    looked for, and the columns that are there."""
    value: Any = row
    parts = key.split(".")
    for depth, part in enumerate(parts):
        parent = ".".join(parts[:depth])
        if not isinstance(value, dict):
            raise ValueError(f"{key_arg}={key!r}: {parent!r} in {where} is a {type(value).__name__}, not a mapping "
                             f"with a {part!r} column ({_KEY_HINT})")
        if part not in value:
            inside = f"under {parent!r} " if parent else ""
            raise ValueError(f"{key_arg}={key!r}: no column {part!r} {inside}in {where}; available: "
                             f"{sorted(value)}. Set {key_arg} to one of them ({_KEY_HINT})")
        value = value[part]
    return value


def _prompt_text(value: Any, key: str, where: str) -> str:
    """A prompt column is text, or a chat (list of {"role", "content"} messages) whose last user message is the
    prompt."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        for message in reversed(value):
            if isinstance(message, dict) and message.get("role") == "user":
                return message["content"]
        raise ValueError(f"prompt_key={key!r} in {where} is a list with no {{'role': 'user', ...}} message")
    raise ValueError(f"prompt_key={key!r} in {where} is a {type(value).__name__}; expected text or a chat "
                     "(a list of {'role', 'content'} messages)")


class PromptDataset(Dataset):
    """A map-style dataset of prompt rows: ``prompt`` (str), ``answer`` (str) and the row's other columns.

    ``path_or_name`` is a local ``.jsonl`` / ``.json`` (a list of objects) / ``.parquet`` file, read directly, or
    anything else, passed to ``datasets.load_dataset(path_or_name, split=split)`` (``split`` is ignored for local
    files). ``prompt_key`` and ``answer_key`` pick the columns (dotted paths reach nested values); left None, they
    come from ``preset`` ("dapo_math" or "math500"), else are "prompt" and "answer". ``template``, if given, is the
    prompt text with ``{prompt}`` where the row's prompt goes; other braces in it are kept as they are, so
    ``"... within \\boxed{}.\\n{prompt}"`` works. ``limit`` keeps the first rows only.
    """

    def __init__(self, path_or_name: str, prompt_key: str | None = None, answer_key: str | None = None,
                 split: str = "train", template: str | None = None, limit: int | None = None,
                 preset: Literal["dapo_math", "math500"] | None = None) -> None:
        if preset is not None and preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; known presets: {sorted(PRESETS)}")
        if template is not None and "{prompt}" not in template:
            raise ValueError(f"template {template!r} has no '{{prompt}}' placeholder for the prompt text")
        preset_prompt_key, preset_answer_key = PRESETS[preset] if preset is not None else ("prompt", "answer")
        prompt_key = prompt_key or preset_prompt_key
        answer_key = answer_key or preset_answer_key

        path = Path(path_or_name)
        local = path.suffix.lower() in _LOCAL_SUFFIXES
        # A hub dataset may download for minutes on its first use (and `datasets` alone takes seconds to import).
        with waiting_for(f"loading prompts from {path_or_name}" + ("" if local else f" (split {split!r})"), log):
            rows = _read_local(path, limit) if local else _read_hub(path_or_name, split, limit)
        if not rows:
            raise ValueError(f"prompt dataset {path_or_name!r} (split {split!r}) has no rows")

        self.examples: list[dict[str, Any]] = []
        for index, row in enumerate(rows):
            where = f"row {index} of {path_or_name}"
            if not isinstance(row, dict):
                raise ValueError(f"{where} is a {type(row).__name__}, not an object of columns")
            prompt = _prompt_text(_lookup(row, prompt_key, "prompt_key", where), prompt_key, where)
            answer = _lookup(row, answer_key, "answer_key", where)
            if answer is None:
                raise ValueError(f"answer_key={answer_key!r} is empty (null) in {where}")
            if template is not None:
                prompt = template.replace("{prompt}", prompt)
            # Answers are compared as text by the rewards; numeric gold (12) becomes "12".
            example = {**row, "prompt": prompt, "answer": str(answer)}
            # A batch hands the reward one list per column, so every row must have the same columns; checked here
            # rather than at the first batch that mixes two kinds of rows, which may come late in a run.
            if self.examples and example.keys() != self.examples[0].keys():
                first = self.examples[0].keys()
                raise ValueError(
                    f"{where} has other columns than row 0: missing {sorted(first - example.keys())}, extra "
                    f"{sorted(example.keys() - first)}. Every row needs the same columns (the reward takes each "
                    "column as a list): add the missing ones (null is fine) or remove the extra ones")
            self.examples.append(example)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.examples[index]
