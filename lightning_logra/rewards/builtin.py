"""The built-in verifiable rewards: 1.0 for a right answer, 0.0 otherwise, registered under the names a config gives
them (`BUILTIN`, `model.reward: exact_match`).

Every reward has TRL's signature ``fn(prompts, completions, completion_ids, **columns) -> list[float | None]``:
``columns`` are the dataset's extra columns, each a list aligned with ``completions`` (``answer=[...]``), and unknown
ones are ignored, so the same function works in this trainer and as a TRL reward function. A completion is a string,
or, in conversational form (a chat template is applied), a list of messages ``[{"role": "assistant", "content":
...}]``; the built-in rewards take either. TRL lets a reward return None for "does not apply to this sample"; the
rewards here judge every sample and never do. A reward with settings is a class whose instances have that signature
(`MathAnswer`), built from a config's ``class_path``/``init_args``. math_answer bounds each check, in time and
memory, in a pool of verifier processes.
"""

import logging
import re
import threading
from collections.abc import Callable
from typing import Literal

from lightning_logra.base.child import DEFAULT_MEMORY_GIB, check_memory_gib
from lightning_logra.base.settings import check_positive
from lightning_logra.rewards.processes import CheckPool

RewardFn = Callable[..., list[float | None]]
BUILTIN: dict[str, RewardFn] = {}  # the built-in rewards by the names a config gives them


def builtin_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Registers a reward function under `name` (`model.reward: <name>`)."""

    def register(fn: RewardFn) -> RewardFn:
        BUILTIN[name] = fn
        return fn

    return register


DEFAULT_TIMEOUT_S = 5.0
DEFAULT_WORKERS = 2

Completion = str | list[dict]  # a text, or in conversational form a list of messages


def completion_text(completion: Completion) -> str:
    """A completion's text, from either of TRL's forms: a string, or a list of messages whose last is the model's
    (``[{"role": "assistant", "content": text}]``)."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


@builtin_reward("exact_match")
def exact_match(prompts: list, completions: list[Completion], answer: list[str], **_: object) -> list[float | None]:
    """1.0 where the completion is the answer up to surrounding whitespace (the embedded arithmetic task, whose
    completions end at EOS, so nothing may follow the answer)."""
    return [float(completion_text(completion).strip() == gold.strip())
            for completion, gold in zip(completions, answer, strict=True)]


@builtin_reward("environment")
def environment(prompts: list, completions: list[Completion], environment_reward: list[float | None] | None = None,
                **_: object) -> list[float | None]:
    """The episode's own reward, from its environment's `reward()` (multi-turn episodes, docs/multi-turn.md); None
    where it has none (nothing is learned from that episode by this reward)."""
    if environment_reward is None:
        raise ValueError("model.reward: environment scores an episode with its environment's reward(), and these "
                         "completions come from no environment: set model.episodes.environment_factory to a class with "
                         "a reward method (and model.episodes.max_turns), or choose another reward")
    return list(environment_reward)


# The last line that starts with "Answer:", the form DAPO-Math's prompts ask for ("Answer: $Answer" on its own
# line). Markdown bold around the label ("**Answer:** 12") is common enough in model output to accept.
_ANSWER_LINE = re.compile(r"^[ \t*]*answer[ \t*]*:[ \t*]*(.+?)[ \t]*$", re.IGNORECASE | re.MULTILINE)


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` whose braces close; None if there is none (a completion cut off
    inside the box has no answer)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    content_start = start + len("\\boxed{")
    for i in range(content_start - 1, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[content_start:i]
    return None


def extract_final_answer(completion: str) -> str | None:
    """The model's final answer: the last ``\\boxed{...}``, else the last ``Answer: ...`` line, else None."""
    boxed = _last_boxed(completion)
    if boxed is not None:
        return boxed
    lines = _ANSWER_LINE.findall(completion)
    return lines[-1] if lines else None


def _as_latex(answer: str) -> str:
    """Math-verify extracts LaTeX only between delimiters, so a bare answer ("\\frac{1}{2}", "34") is wrapped in
    ``$...$``; one already wrapped ("$\\frac{1}{2}$" on an Answer line) is unwrapped first so it is not doubled."""
    answer = answer.strip()
    if len(answer) >= 2 and answer.startswith("$") and answer.endswith("$"):
        answer = answer.strip("$")
    return f"${answer}$"


def _judge(prediction: str, gold: str) -> float:
    """Runs in a verifier process. Math-verify's own timeouts are off (None): they use ``signal.alarm``, which
    only works on a process's main thread; the parent bounds this call instead."""
    from math_verify import parse, verify

    # Math-verify warns once per process that its timeouts are disabled; that is deliberate here.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    gold_parsed = parse(_as_latex(gold), parsing_timeout=None)
    prediction_parsed = parse(_as_latex(prediction), parsing_timeout=None)
    return float(verify(gold_parsed, prediction_parsed, timeout_seconds=None))


# The math verifier pools of this process, by their number of workers and memory limit, started on first use
# (importing this module starts nothing).
_MATH_POOLS: dict[tuple[int, float | None], CheckPool] = {}
_MATH_POOLS_LOCK = threading.Lock()


def _math_pool(workers: int, memory_gib: float | None) -> CheckPool:
    with _MATH_POOLS_LOCK:
        if (workers, memory_gib) not in _MATH_POOLS:
            _MATH_POOLS[workers, memory_gib] = CheckPool(
                _judge, workers, warmup=("1", "1"), name="math verifier",
                start_error="math_answer needs math-verify: pip install 'lightning-logra[math]'",
                memory_gib=memory_gib,
                memory_advice="if right answers need more, raise memory_gib in model.reward's init_args "
                              "(class_path: lightning_logra.rewards.MathAnswer; null: no limit)")
        return _MATH_POOLS[workers, memory_gib]


@builtin_reward("math_answer")
def math_answer(prompts: list, completions: list[Completion], answer: list[str], timeout_s: float = DEFAULT_TIMEOUT_S,
                workers: int = DEFAULT_WORKERS, memory_gib: float | None = DEFAULT_MEMORY_GIB,
                **_: object) -> list[float | None]:
    """1.0 where the completion's final answer (its last ``\\boxed{}``, else its last ``Answer:`` line) is
    mathematically equal to the gold answer by math-verify (``\\frac{1}{2}`` = ``0.5``, ``2\\sqrt{2}`` =
    ``\\sqrt{8}``), else 0.0. The answers are checked by ``workers`` processes in parallel; each check is cut off
    after ``timeout_s`` seconds, or when it needs more than ``memory_gib`` GiB, and then scores 0.0. Safe to call
    from any thread."""
    predictions = [extract_final_answer(completion_text(completion)) for completion in completions]
    items = [None if prediction is None else (prediction, str(gold))
             for prediction, gold in zip(predictions, answer, strict=True)]
    return _math_pool(workers, memory_gib).score(items, timeout_s)


class MathAnswer:
    """`math_answer` with its settings, for a config::

        reward:
          class_path: lightning_logra.rewards.MathAnswer
          init_args: {timeout_s: 10.0, workers: 4}

    Args:
        timeout_s: the seconds one answer's check may take; past it the answer scores 0.0 (sympy can spend minutes
            on an answer such as ``10^{10^{10}}``), its verifier process is replaced, and the others go on.
        workers: verifier processes checking a batch's answers in parallel (each a few milliseconds per answer,
            and about 100 MB for sympy).
        memory_gib: the address space, in GiB, a verifier process may map beyond what it holds once started
            (default: 8, or a quarter of the machine's memory if less); a check that needs more scores 0.0 and its
            process is replaced, as at the timeout. None: no limit.
    """

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S, workers: int = DEFAULT_WORKERS,
                 memory_gib: float | None = DEFAULT_MEMORY_GIB) -> None:
        check_positive("model.reward: MathAnswer's timeout_s", timeout_s, "number of seconds")
        check_positive("model.reward: MathAnswer's workers", workers, "number of processes", integer=True)
        check_memory_gib(memory_gib, "model.reward: MathAnswer's memory_gib")
        self.timeout_s, self.workers, self.memory_gib = timeout_s, workers, memory_gib

    def __call__(self, prompts: list, completions: list[Completion], answer: list[str],
                 **_: object) -> list[float | None]:
        return math_answer(prompts, completions, answer, timeout_s=self.timeout_s, workers=self.workers,
                           memory_gib=self.memory_gib)

    def __repr__(self) -> str:
        return f"MathAnswer(timeout_s={self.timeout_s}, workers={self.workers}, memory_gib={self.memory_gib})"


# The names of BUILTIN as a type: `RLVRModule`'s reward parameter is typed `RewardName | RewardFn`, so jsonargparse
# checks a name against them, imports a dotted path to a function, and builds a class_path/init_args component
# (checking init_args against the class), all at parse time.
RewardName = Literal[tuple(BUILTIN)]
