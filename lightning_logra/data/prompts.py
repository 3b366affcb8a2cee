"""Prompt datasets for RLVR: Arrow-backed rows with a ``prompt`` and an ``answer``, loaded by ``datasets``.

Every source goes through ``datasets.load_dataset``: a hub dataset with its subset (config) name, files, revision
and split, a local folder laid out like a hub repository (or written by ``save_to_disk``), or one local
JSONL/JSON/Parquet/CSV file. The rows stay in Arrow; a training step reads only its own batch of them.

The trainer samples completions for ``prompt`` and hands ``answer`` (and every other column) to the reward function.
A prompt is text, or a conversation: a list of ``{"role", "content"}`` messages (TRL's conversational format), which
the trainer passes whole through the tokenizer's chat template, a system message included.
"""

import codecs
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
from torch.utils.data import Dataset

from lightning_logra.base.settings import check_positive
from lightning_logra.base.waits import waiting_for

log = logging.getLogger(__name__)

# (prompt_key, answer_key) of the formats users know.
PRESETS: dict[str, tuple[str, str]] = {
    # BytedTsinghua-SIA/DAPO-Math-17k: "prompt" is a chat whose user message already asks for a final
    # "Answer: $Answer" line; the gold answer sits in "reward_model": {"ground_truth": ...}. Its 1.79M rows are
    # about 17k prompts repeated about 100 times each, which `deduplicate` (on by default) undoes.
    "dapo_math": ("prompt", "reward_model.ground_truth"),
    # HuggingFaceH4/MATH-500: flat columns problem / solution / answer / subject / level / unique_id.
    "math500": ("problem", "answer"),
}

# A path with one of these suffixes is one local file, read by the `datasets` builder of that format.
LOCAL_FORMATS: dict[str, str] = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}

_KEY_HINT = "dotted paths such as 'reward_model.ground_truth' reach nested values"
_SCAN_BATCH = 10_000  # rows read into Python at a time while checking and deduplicating
_CHECK_BYTES = 1 << 24  # bytes of a file read at a time while looking for bytes that are not UTF-8


@dataclass
class DatasetSource:
    """Where a prompt set comes from: the arguments of ``datasets.load_dataset(path, name, data_files=...,
    revision=..., split=...)``.

    Args:
        path: a hub dataset ("openai/gsm8k"), a local folder (a hub-style repository, or one written by
            ``save_to_disk``), one local .jsonl/.json/.parquet/.csv file, or a builder name ("json", "parquet",
            "csv") with ``data_files``.
        name: the subset (config) name of a dataset that has several ("main" or "socratic" for openai/gsm8k).
        data_files: which files of the repository or folder to read: a path or glob, a list of them, or
            {split: files}.
        revision: a branch, tag or commit of a hub dataset; pin a commit for a run that must be reproducible.
        split: the split to read, or a slice of one ("train[:1000]"). None: ``data.split`` for training,
            ``data.eval_split`` for val/test; a single local file has one split, "train".
    """

    path: str
    name: str | None = None
    data_files: str | list[str] | dict[str, str | list[str]] | None = None
    revision: str | None = None
    split: str | None = None


def _load_rows(source: DatasetSource, default_split: str, config_key: str):
    """The rows of ``source`` as a ``datasets.Dataset``; errors a config can fix name ``config_key``."""
    # Imported only here: the import alone takes seconds.
    from datasets import load_dataset
    from datasets.exceptions import DatasetGenerationError

    path = Path(source.path).expanduser()
    builder = LOCAL_FORMATS.get(path.suffix.lower())
    if builder is not None:
        if not path.is_file():
            raise FileNotFoundError(f"{config_key}: no such file {source.path!r} (absolute: {path.resolve()}); give "
                                    f"the path of a {'/'.join(sorted(LOCAL_FORMATS))} file")
        if source.data_files is not None:
            raise ValueError(f"{config_key}: path {source.path!r} is a file, so data_files has nothing to choose "
                             "from; set path to a folder or to a builder name ('json', 'parquet', 'csv')")
        if source.revision is not None:
            raise ValueError(f"{config_key}: revision {source.revision!r} applies to hub datasets; the local file "
                             f"{source.path!r} has no revisions")
        if source.name is not None:
            raise ValueError(f"{config_key}: name {source.name!r} picks a subset of a dataset that has several; the "
                             f"local file {source.path!r} is one set")
        args, kwargs = (builder,), {"data_files": str(path), "split": source.split or "train"}
    else:
        if source.revision is not None and path.exists():
            raise ValueError(f"{config_key}: revision {source.revision!r} applies to hub datasets; the local folder "
                             f"{source.path!r} has no revisions")
        args = (source.path, source.name)
        kwargs = {"data_files": source.data_files, "revision": source.revision, "split": source.split or default_split}
    try:
        rows = load_dataset(*args, **kwargs)
    except ValueError as error:
        # A missing or unknown subset name, an unknown split, a file without rows: all fixed in the config.
        raise ValueError(f"{config_key}: {error}\n({config_key} takes path, name, data_files, revision and split, "
                         "the arguments of datasets.load_dataset)") from error
    except FileNotFoundError as error:
        # A hub dataset that is not there (or not reachable offline), data_files that match nothing.
        raise FileNotFoundError(f"{config_key}: {error}") from error
    except DatasetGenerationError as error:
        # A file that does not parse; the cause names the row, unless it is bytes that are not UTF-8 (CSV, JSON).
        if builder in ("json", "csv"):
            _check_utf8_file(path, config_key)
        raise ValueError(f"{config_key}: {source.path}: {error.__cause__ or error}") from error
    # A JSONL or Parquet file loads with bytes that are not UTF-8 in a text column; they would fail only when read,
    # in the middle of training if the column is not the prompt's or the answer's. Arrow's check is fast (GB/s).
    try:
        rows.data.validate(full=True)
    except pa.ArrowInvalid as error:
        if builder in ("json", "csv"):
            _check_utf8_file(path, config_key)
        raise ValueError(f"{config_key}: {source.path}: {_invalid_row(rows) or error}; save the data as UTF-8, or "
                         "remove that row") from error
    return rows


def _check_utf8_file(path: Path, config_key: str) -> None:
    """Raises an error naming the byte offset and line of the first bytes of a text file that are not UTF-8."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, lines = 0, 1  # bytes before this chunk, and the line it starts on
    with path.open("rb") as file:
        while True:
            chunk = file.read(_CHECK_BYTES)
            held = len(decoder.getstate()[0])  # the start of a character cut by the previous chunk's end
            try:
                decoder.decode(chunk, final=not chunk)  # the end of the file: a character cut there is an error
            except UnicodeDecodeError as error:
                at = offset - held + error.start  # the error counts from the held bytes, which hold no newline
                line = lines + chunk.count(b"\n", 0, max(at - offset, 0))
                raise ValueError(f"{config_key}: {path} is not UTF-8 text: line {line} (byte offset {at}) has "
                                 f"0x{error.object[error.start]:02x} ({error.reason}); save the file as UTF-8 (for "
                                 "example `iconv -f latin1 -t utf-8`), or remove that row") from None
            if not chunk:
                return
            offset, lines = offset + len(chunk), lines + chunk.count(b"\n")


def _invalid_row(rows) -> str | None:
    """Which row and column of ``rows`` hold text that is not UTF-8 (None: none does)."""
    table = rows.data.table
    for name, column in zip(table.column_names, table.columns):
        start = 0
        for chunk in column.chunks:
            try:
                chunk.validate(full=True)
            except pa.ArrowInvalid:
                for index in range(len(chunk)):
                    try:
                        chunk[index].as_py()
                    except UnicodeDecodeError:
                        return f"row {start + index}, column {name!r}, holds text that is not UTF-8"
            start += len(chunk)
    return None


def _feature_at(features: Any, key: str, key_arg: str, where: str) -> Any:
    """The feature (column type) at ``key``, dotted for nested structs; a missing column names the key, where it was
    looked for, and the columns that are there."""
    feature = features
    parts = key.split(".")
    for depth, part in enumerate(parts):
        parent = ".".join(parts[:depth])
        if not isinstance(feature, dict):  # datasets describes a struct column as a dict of its fields
            raise ValueError(f"{key_arg}={key!r}: {parent!r} in {where} is a {feature}, not a mapping with a "
                             f"{part!r} column ({_KEY_HINT})")
        if part not in feature:
            inside = f"under {parent!r} " if parent else ""
            raise ValueError(f"{key_arg}={key!r}: no column {part!r} {inside}in {where}; available: "
                             f"{sorted(feature)}. Set {key_arg} to one of them ({_KEY_HINT})")
        feature = feature[part]
    return feature


def _value_at(row: dict[str, Any], key: str) -> Any:
    """The value at ``key`` (dotted for nested structs); None where it or a struct above it is null."""
    value: Any = row
    for part in key.split("."):
        if value is None:
            return None
        value = value[part]
    return value


def _is_text(feature: Any) -> bool:
    return getattr(feature, "dtype", None) in ("string", "large_string")


def _is_conversation(feature: Any) -> bool:
    """A list column of {"role", "content"} structs."""
    messages = getattr(feature, "feature", None)
    return isinstance(messages, dict) and {"role", "content"} <= messages.keys()


def _prompt_key_of(prompt: str | list[dict[str, Any]]) -> str:
    """What two prompts must share to be the same prompt: the text, or every message's fields and values."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


def _is_blank(prompt: str | list[dict[str, Any]]) -> bool:
    """No question to answer: text that is empty or only whitespace, or a conversation whose last user message (the
    one the model answers, where a template goes) is."""
    if not isinstance(prompt, str):
        prompt = next(message for message in reversed(prompt) if message["role"] == "user")["content"]
    return not (prompt or "").strip()


def _apply_template(prompt: str | list[dict[str, Any]], template: str) -> str | list[dict[str, Any]]:
    """``template`` with the prompt in place of ``{prompt}``; in a conversation, around the last user message."""
    if isinstance(prompt, str):
        return template.replace("{prompt}", prompt)
    last_user = max(i for i, message in enumerate(prompt) if message["role"] == "user")
    message = prompt[last_user]
    return [*prompt[:last_user], {**message, "content": template.replace("{prompt}", message["content"])},
            *prompt[last_user + 1 :]]


class PromptDataset(Dataset):
    """A map-style dataset of prompt rows: ``prompt`` (text or a conversation), ``answer`` (text) and the row's other
    columns, read from an Arrow-backed ``datasets.Dataset`` (``self.rows``) a batch at a time.

    ``source`` is a ``DatasetSource``, or its path alone. ``prompt_key`` and ``answer_key`` pick the columns (dotted
    paths reach nested values); left None, they come from ``preset`` ("dapo_math" or "math500"), else are "prompt"
    and "answer". ``template``, if given, is the prompt text with ``{prompt}`` where the row's prompt goes (in a
    conversation: the last user message's text); other braces in it are kept as they are, so
    ``"... within \\boxed{}.\\n{prompt}"`` works. ``deduplicate`` drops rows whose prompt repeats an earlier row's
    (the first occurrence stays, in order). ``limit`` keeps the first rows only (after deduplication).
    ``split`` is the split read when the source names none. ``config_key`` ("data.train") names the setting in
    errors.
    """

    def __init__(self, source: str | DatasetSource, prompt_key: str | None = None, answer_key: str | None = None,
                 split: str = "train", template: str | None = None, limit: int | None = None,
                 preset: Literal["dapo_math", "math500"] | None = None, deduplicate: bool = True,
                 config_key: str = "data.train") -> None:
        if preset is not None and preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; known presets: {sorted(PRESETS)}")
        if template is not None and "{prompt}" not in template:
            raise ValueError(f"template {template!r} has no '{{prompt}}' placeholder for the prompt text")
        check_positive("limit", limit, "number of rows", integer=True, null="all of them")
        preset_prompt_key, preset_answer_key = PRESETS[preset] if preset is not None else ("prompt", "answer")
        self.prompt_key = prompt_key or preset_prompt_key
        self.answer_key = answer_key or preset_answer_key
        self.template = template
        self.source = source if isinstance(source, DatasetSource) else DatasetSource(source)

        # A hub dataset may download for minutes on its first use (and `datasets` alone takes seconds to import).
        with waiting_for(f"loading prompts for {config_key} from {self.source.path}", log):
            rows = _load_rows(self.source, split, config_key)
        where = f"{config_key} ({self.source.path})"
        if len(rows) == 0:
            raise ValueError(f"{where} has no rows")
        prompt_feature = _feature_at(rows.features, self.prompt_key, "prompt_key", where)
        _feature_at(rows.features, self.answer_key, "answer_key", where)
        if not (_is_text(prompt_feature) or _is_conversation(prompt_feature)):
            raise ValueError(f"prompt_key={self.prompt_key!r} in {where} is a {prompt_feature}; expected text or a "
                             "conversation (a list of {'role', 'content'} messages)")
        keep = self._scan(rows, deduplicate, where)
        if limit is not None:
            keep = keep[:limit]
        # select() keeps the Arrow table and adds an index mapping: nothing is copied into Python.
        self.rows = rows if len(keep) == len(rows) else rows.select(keep)

    def _scan(self, rows, deduplicate: bool, where: str) -> list[int]:
        """One pass over the prompt and answer columns: every row checked, and the indices of the rows to keep."""
        columns = sorted({self.prompt_key.split(".")[0], self.answer_key.split(".")[0]})
        keep: list[int] = []
        seen: set[str] = set()
        blank = repeated = 0
        batches = rows.select_columns(columns).iter(batch_size=_SCAN_BATCH)
        each_row = (dict(zip(batch, values)) for batch in batches for values in zip(*batch.values()))
        for index, row in enumerate(each_row):
            prompt = _value_at(row, self.prompt_key)
            if prompt is None:
                raise ValueError(f"prompt_key={self.prompt_key!r} is empty (null) in row {index} of {where}")
            if not isinstance(prompt, str) and not any(message["role"] == "user" for message in prompt):
                raise ValueError(f"prompt_key={self.prompt_key!r} in row {index} of {where} is a conversation "
                                 "with no {'role': 'user', ...} message")
            if _value_at(row, self.answer_key) is None:
                raise ValueError(f"answer_key={self.answer_key!r} is empty (null) in row {index} of {where}")
            if _is_blank(prompt):  # nothing to answer: its samples would train on noise
                blank += 1
                continue
            if deduplicate:
                key = _prompt_key_of(prompt)
                if key in seen:
                    repeated += 1
                    continue
                seen.add(key)
            keep.append(index)
        if not keep:
            raise ValueError(f"prompt_key={self.prompt_key!r} is empty (no text, or only whitespace) in every row of "
                             f"{where}; point prompt_key at the column that holds the prompts")
        if blank:
            log.warning("%s: %d of %d rows have an empty prompt (prompt_key=%r: no text, or only whitespace; in a "
                        "conversation, the last user message) and were dropped", where, blank, len(rows),
                        self.prompt_key)
        if repeated:
            log.warning("%s: %d of %d rows repeat an earlier row's prompt and were dropped, %d prompts left "
                        "(deduplicate: false keeps them)", where, repeated, len(rows), len(keep))
        return keep

    def _format(self, row: dict[str, Any]) -> dict[str, Any]:
        prompt = _value_at(row, self.prompt_key)
        if self.template is not None:
            prompt = _apply_template(prompt, self.template)
        # Answers are compared as text by the rewards; numeric gold (12) becomes "12".
        return {**row, "prompt": prompt, "answer": str(_value_at(row, self.answer_key))}

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self._format(self.rows[index])

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        # A DataLoader asks for a whole batch at once: one Arrow read instead of one per row.
        columns = self.rows[indices]  # {column: [value per index]}
        return [self._format(dict(zip(columns, values))) for values in zip(*columns.values())]
