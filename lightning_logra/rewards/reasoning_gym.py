"""The reward of reasoning-gym tasks (`data.ReasoningGymDataModule`): each completion's answer, taken from between
its answer tags (or after the phrase that states it), scored by its task's own scorer
(`reasoning_gym.get_score_answer_fn`) against its item.

The answer is extracted first, as reasoning-gym's own training code does: its default scorer gives partial credit to
any text that contains the answer ("... 12 ... 7 ..." for "7"), so the whole completion would be scored for what it
mentions. Called in the reward's process, like every reward (`processes.TimedReward`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
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

    A completion without an answer scores 0.0.

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

    def __call__(self, prompts: list, completions: list[Completion], task: list[str], entry: list[dict[str, Any]],
                 **_: object) -> list[float]:
        scores = []
        for prompt, completion, name, item in zip(prompts, completions, task, entry, strict=True):
            score = max([self._score(name, answer, item) for answer in self.answers(prompt, completion)], default=0.0)
            scores.append(score if self.partial_credit else float(score >= 1.0))
        return scores

    @staticmethod
    def _score(task: str, answer: str, item: dict[str, Any]) -> float:
        score = _scorer(task)  # outside the try: a missing reasoning-gym or an unknown task fails, not scores 0
        try:
            return float(score(answer, item))
        except Exception:  # an answer the scorer cannot even read (a parse that raises) is not a right one
            return 0.0

    def __repr__(self) -> str:
        return (f"ReasoningGymScore(answer_format={self.answer_format!r}, tag={self.tag!r}, phrase={self.phrase!r}, "
                f"partial_credit={self.partial_credit})")
