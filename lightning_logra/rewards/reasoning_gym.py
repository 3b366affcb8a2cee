"""The reward of reasoning-gym tasks (`data.ReasoningGymDataModule`): each completion's answer, taken from between
its answer tags (or after the phrase that states it), scored by its task's own scorer
(`reasoning_gym.get_score_answer_fn`) against its item.

The answer is extracted first, as reasoning-gym's own training code does: its default scorer gives partial credit to
any text that contains the answer ("... 12 ... 7 ..." for "7"), so the whole completion would be scored for what it
mentions. Called in the reward's process, like every reward (`processes.TimedReward`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping
from typing import Any, Literal

from lightning_logra.rewards.builtin import Completion, completion_text


def prefill(prompt: str | list[dict[str, str]], marker: str) -> str:
    """What the prompt has begun the answer with: a conversation's last message when it is the assistant's (an answer
    prefix); a text prompt's `marker` when it ends with it."""
    if isinstance(prompt, str):
        return marker if prompt.rstrip().endswith(marker) else ""
    return prompt[-1]["content"] if prompt and prompt[-1]["role"] == "assistant" else ""


def extract_tagged_answer(text: str, tag: str = "answer") -> str | None:
    """The text after the last `<tag>` of `text`, up to the `</tag>` that closes it, or to the end when none does
    (the completion stopped with its answer open); stripped. None when there is no `<tag>`."""
    start = text.rfind(f"<{tag}>")
    if start < 0:
        return None
    answer = text[start + len(tag) + 2 :]
    end = answer.find(f"</{tag}>")
    return (answer if end < 0 else answer[:end]).strip()


def extract_stated_answer(text: str, phrase: str = "The answer is") -> str | None:
    """The rest of the line after the last `phrase` of `text` ("The answer is 18." → "18."), stripped; None when
    `phrase` is not there."""
    start = text.rfind(phrase)
    if start < 0:
        return None
    return text[start + len(phrase) :].split("\n", 1)[0].strip()


def read_entry(entry: Any, row: str) -> Mapping[str, Any]:
    """The row's `entry` as the scorers read it: the item reasoning-gym made (a mapping with its question, answer and
    metadata), or that item as JSON text (a set written to a file). Anything else is an error naming `row`: scored,
    every answer to it would be 0.0, the right ones too."""
    if isinstance(entry, str):
        try:
            entry = json.loads(entry)
        except json.JSONDecodeError as error:
            raise ValueError(f"ReasoningGymScore: {row}: its entry column is text but not JSON ({error}): it must be "
                             "the item as reasoning-gym made it, or that item as JSON text") from None
    if not isinstance(entry, Mapping):
        raise ValueError(f"ReasoningGymScore: {row}: its entry column must be the item as reasoning-gym made it (a "
                         f"mapping with its question, answer and metadata, or that as JSON text), got "
                         f"{_shown(entry)}")
    missing = [key for key in ("answer", "metadata") if key not in entry]
    if missing:
        raise ValueError(f"ReasoningGymScore: {row}: its entry column must be the item as reasoning-gym made it, "
                         f"with its question, answer and metadata; got a mapping without {', '.join(missing)}: "
                         f"{_shown(entry)}")
    return entry


def _shown(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."


@functools.cache
def _scorer(task: str) -> Callable[[str | None, dict[str, Any]], float]:
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(task)


class ReasoningGymScore:
    """The reward of reasoning-gym tasks, for a config::

        reward:
          class_path: lightning_logra.rewards.ReasoningGymScore
          init_args: {answer_format: tag, partial_credit: false}

    Reads the rows' `task` and `entry` columns (the data module's). The answer is read from the completion, after
    what the prompt began it with (the data module's `answer_prefix`), in one of two forms:

    - `tag` (the default): the text inside the last `<answer>…</answer>` (`tag` names it), up to the end when the
      completion stopped before closing it; what the data module's default instruction and prefix ask for;
    - `phrase`: the rest of the line after the last `phrase` ("The answer is 18." gives "18."); a final period may be
      the sentence's, so the answer is also read without it, and the better score counts. The form small instruct
      models follow best (`configs/smollm2_reasoning.yaml` begins the answer with the phrase).

    A completion without an answer scores 0.0; an answer the task's scorer cannot parse scores 0.0. A row whose
    `entry` is not the item reasoning-gym made (or that item as JSON text, which is read), or one the task's scorer
    cannot read (it fails on the entry's own answer), is an error naming the row: every answer to it would score 0.0.

    Args:
        answer_format: `tag` or `phrase`, as above.
        tag: the answer's tag in the `tag` form (`answer`: `<answer>…</answer>`).
        phrase: what states the answer in the `phrase` form.
        partial_credit: False (the default): 1.0 where the task's scorer gives the answer full marks, else 0.0 — a
            verifiable 0/1 reward, whose pass@k counts solved items. True: the scorer's own score in [0, 1], partial
            credit included (a task's scorer may give some for a near answer, or for the answer inside more text);
            pass@k then counts any credit as a pass.
    """

    def __init__(self, answer_format: Literal["tag", "phrase"] = "tag", tag: str = "answer",
                 phrase: str = "The answer is", partial_credit: bool = False) -> None:
        if answer_format not in ("tag", "phrase"):
            raise ValueError(f"model.reward: ReasoningGymScore's answer_format must be 'tag' or 'phrase', got "
                             f"{answer_format!r}")
        if not isinstance(tag, str) or not tag.strip() or any(c in tag for c in "<>/ "):
            raise ValueError(f"model.reward: ReasoningGymScore's tag must be a name such as 'answer' (no <, >, / or "
                             f"space), got {tag!r}")
        if not isinstance(phrase, str) or not phrase.strip():
            raise ValueError(f"model.reward: ReasoningGymScore's phrase must be some text, got {phrase!r}")
        self.answer_format, self.tag, self.phrase, self.partial_credit = answer_format, tag, phrase, partial_credit

    def answers(self, prompt: str | list[dict[str, str]], completion: Completion) -> list[str]:
        """The readings of the completion's answer (none: it states none)."""
        if self.answer_format == "tag":
            text = prefill(prompt, f"<{self.tag}>") + completion_text(completion)
            answer = extract_tagged_answer(text, self.tag)
            return [] if answer is None else [answer]
        answer = extract_stated_answer(prefill(prompt, self.phrase) + completion_text(completion), self.phrase)
        if answer is None:
            return []
        return [answer, answer[:-1].rstrip()] if answer.endswith(".") else [answer]

    def __call__(self, prompts: list, completions: list[Completion], task: list[str],
                 entry: list[dict[str, Any] | str], **_: object) -> list[float]:
        scores = []
        for index, (prompt, completion, name, item) in enumerate(zip(prompts, completions, task, entry, strict=True)):
            row = f"the row of completion {index} ({name})"
            item = read_entry(item, row)
            answers = self.answers(prompt, completion)
            score = max([self._score(name, answer, item, row) for answer in answers], default=0.0)
            scores.append(score if self.partial_credit else float(score >= 1.0))
        return scores

    @staticmethod
    def _score(task: str, answer: str, item: Mapping[str, Any], row: str) -> float:
        score = _scorer(task)  # outside the try: a missing reasoning-gym or an unknown task fails, not scores 0
        try:
            return float(score(answer, item))
        except Exception as error:
            # An answer the scorer cannot even read (a parse that raises) is not a right one; but where it cannot
            # read the entry either, every answer would score 0, the right ones too: that is the data's fault.
            # (Every task's scorer reads its own items' answers without raising.)
            try:
                score(item["answer"], item)
            except Exception:
                raise ValueError(f"ReasoningGymScore: {row}: {task}'s scorer cannot read its entry "
                                 f"(it fails on the entry's own answer too: {type(error).__name__}: {error}); the "
                                 "entry column must hold the item as reasoning-gym made it, metadata included"
                                 ) from error
            return 0.0

    def __repr__(self) -> str:
        return (f"ReasoningGymScore(answer_format={self.answer_format!r}, tag={self.tag!r}, phrase={self.phrase!r}, "
                f"partial_credit={self.partial_credit})")
