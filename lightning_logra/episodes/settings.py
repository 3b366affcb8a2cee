"""The module's episode settings, `model.episodes` (None: one completion per prompt): checked before anything loads,
and made into the run's `EpisodeRunner`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from lightning_logra.base.child import DEFAULT_MEMORY_GIB, check_memory_gib
from lightning_logra.base.settings import check_positive, yaml_as_mappings
from lightning_logra.episodes.environment import tool_schemas
from lightning_logra.episodes.processes import spec_from_settings, spec_tools
from lightning_logra.episodes.runner import EpisodeLimits, EpisodeRunner


@dataclass
class EpisodeSettings:
    """Multi-turn episodes (docs/multi-turn.md): the model's turns, each followed by the environment's answer (tool
    answers, or an observation), carried as token ids; the loss counts only the tokens the engine sampled.

    Args:
        max_turns: the most turns of an episode (1 samples one completion, whose tool calls nobody answers).
        tools: plain functions the model may call, by dotted path (`pkg.module.fn`; TRL's `tools`): their type hints
            and docstrings give the schemas the chat template shows (one without is refused at set-up, as are two
            with one name).
        environment_factory: a class, by dotted path (or class_path and init_args), one instance of which each
            episode talks to (TRL's `environment_factory`): `reset(**row)` gets the dataset row and may return text
            added to the prompt (held to the prompt limit), its public methods are the tools, and an optional
            `reward()` is the episode's own reward, a real number or None (`model.reward: environment`). Refused at
            set-up when it is not a class or cannot be made from its init_args.
            `lightning_logra.episodes.GymAdapter` (init_args env, env_args) takes a gym-like text environment. Made
            and called in environment processes, never in the trainer's.
        max_tokens: the most completion-side tokens of an episode, sampled and the environment's together (None:
            max_turns × model.sampling.max_new_tokens); an answer that would not leave room ends the episode.
        tool_timeout_s: the deadline of each tool call (and of an environment's reset, step and reward): past it the
            model reads that the call timed out, and the environment process is replaced.
        timeout_s: after this many seconds a batch's episodes take no further turn (None: no deadline).
        invalid_tool_call: what a call that cannot be read (an unclosed tag, JSON that does not parse) does: `answer`
            (the model reads why, as the call's answer, and goes on) or `end` (the episode ends there).
        workers: the environment processes (episodes are shared out over them).
        memory_gib: the address space, in GiB, each environment process may map beyond what it holds once started
            (None: no limit).
    """

    max_turns: int = 1
    tools: list[str] | None = None
    environment_factory: str | dict[str, Any] | None = None
    max_tokens: int | None = None
    tool_timeout_s: float = 30.0
    timeout_s: float | None = 600.0
    invalid_tool_call: Literal["answer", "end"] = "answer"
    workers: int = 2
    memory_gib: float | None = DEFAULT_MEMORY_GIB

    def __post_init__(self) -> None:
        """Each error names its key and the fix."""
        check_positive("model.episodes.max_turns", self.max_turns, "number of turns", integer=True)
        if self.environment_factory is None and not self.tools:
            raise ValueError("model.episodes: an episode's turns read the environment's answers, and there is none: "
                             "set model.episodes.tools (functions) or model.episodes.environment_factory (a class), "
                             "or model.episodes: null for one completion per prompt")
        if self.environment_factory is not None and self.tools:
            raise ValueError("model.episodes.tools and model.episodes.environment_factory are both set: an "
                             "environment's tools are its public methods; give the functions as methods of the "
                             "environment, or drop one of the two")
        check_positive("model.episodes.max_tokens", self.max_tokens, "number of tokens", integer=True,
                       null="max_turns × max_new_tokens")
        check_positive("model.episodes.tool_timeout_s", self.tool_timeout_s, "number of seconds")
        check_positive("model.episodes.timeout_s", self.timeout_s, "number of seconds", null="no deadline")
        check_positive("model.episodes.workers", self.workers, "number of processes", integer=True)
        check_memory_gib(self.memory_gib, "model.episodes.memory_gib")
        if self.invalid_tool_call not in ("answer", "end"):
            raise ValueError(f"model.episodes.invalid_tool_call must be 'answer' (the model reads why) or 'end' (the "
                             f"episode ends), got {self.invalid_tool_call!r}")
        # Before anything loads: the environment class can be made from its init_args, the tools import, have one
        # name each and a schema each (the chat template shows the schemas)
        spec = spec_from_settings(self.environment_factory, self.tools, self.invalid_tool_call, 1)
        tool_schemas(spec_tools(spec), "model.episodes.tools" if self.tools else "model.episodes.environment_factory")

    def tokens(self, max_new_tokens: int) -> int:
        """The most completion-side tokens an episode holds, turns of at most `max_new_tokens` each."""
        return self.max_tokens or self.max_turns * max_new_tokens



yaml_as_mappings(EpisodeSettings)


def episode_runner(episodes: EpisodeSettings | None, max_new_tokens: int, tokenizer: Any, stop_token_ids: list[int],
                   pad_token_id: int) -> EpisodeRunner | None:
    """The run's episode runner; None for one completion per prompt."""
    if episodes is None:
        return None
    tokens = episodes.tokens(max_new_tokens)
    # A turn's answers together (and a reset's text) are cut to this many characters before they are tokenized (no
    # token is longer than 32 of them in the vocabularies of the models this trains): answers of megabytes, or a
    # turn of many calls, cost neither memory nor tokenizer time.
    spec = spec_from_settings(episodes.environment_factory, episodes.tools, episodes.invalid_tool_call, 32 * tokens)
    limits = EpisodeLimits(episodes.max_turns, tokens, episodes.tool_timeout_s, episodes.timeout_s)
    return EpisodeRunner(limits, spec, tokenizer, stop_token_ids, pad_token_id, episodes.workers, episodes.memory_gib)
