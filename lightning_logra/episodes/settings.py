"""The module's episode settings (`model.max_turns`, `model.tools`, `model.environment_factory`, ...): checked before
anything loads, and made into the run's `EpisodeRunner`."""

from __future__ import annotations

from typing import Any

from lightning_logra.base.child import check_memory_gib
from lightning_logra.base.settings import check_positive
from lightning_logra.episodes.processes import spec_from_settings, spec_tools
from lightning_logra.episodes.runner import EpisodeRunner, EpisodeSettings


def multi_turn(hp: Any) -> bool:
    """Whether the run draws episodes (an environment or tools is set) rather than one completion per prompt."""
    return hp.environment_factory is not None or bool(hp.tools)


def episode_tokens(hp: Any) -> int:
    """The most completion-side tokens an episode holds."""
    return hp.max_episode_tokens or hp.max_turns * hp.max_new_tokens


def check_episode_settings(hp: Any) -> None:
    """Each error names its key and the fix."""
    check_positive("model.max_turns", hp.max_turns, "number of turns", integer=True)
    if hp.max_turns > 1 and not multi_turn(hp):
        raise ValueError(f"model.max_turns={hp.max_turns}: a turn after the first reads the environment's answer, and "
                         "there is none: set model.tools (functions) or model.environment_factory (a class), or "
                         "model.max_turns: 1")
    if hp.environment_factory is not None and hp.tools:
        raise ValueError("model.tools and model.environment_factory are both set: an environment's tools are its "
                         "public methods; give the functions as methods of the environment, or drop one of the two")
    check_positive("model.max_episode_tokens", hp.max_episode_tokens, "number of tokens", integer=True,
                   null="max_turns × max_new_tokens")
    check_positive("model.tool_timeout_s", hp.tool_timeout_s, "number of seconds")
    check_positive("model.episode_timeout_s", hp.episode_timeout_s, "number of seconds", null="no deadline")
    check_positive("model.environment_workers", hp.environment_workers, "number of processes", integer=True)
    check_memory_gib(hp.environment_memory_gib, "model.environment_memory_gib")
    if hp.invalid_tool_call not in ("answer", "end"):
        raise ValueError(f"model.invalid_tool_call must be 'answer' (the model reads why) or 'end' (the episode "
                         f"ends), got {hp.invalid_tool_call!r}")
    if multi_turn(hp):
        spec_tools(spec_from_settings(hp.environment_factory, hp.tools, hp.invalid_tool_call, 1))  # they import


def episode_runner(hp: Any, tokenizer: Any, stop_token_ids: list[int], pad_token_id: int) -> EpisodeRunner | None:
    """The run's episode runner; None for one completion per prompt."""
    if not multi_turn(hp):
        return None
    # A tool's answer is cut to this many characters before it is tokenized (no token is longer than 32 of them in
    # the vocabularies of the models this trains): an answer of megabytes costs neither memory nor tokenizer time.
    max_chars = 32 * episode_tokens(hp)
    spec = spec_from_settings(hp.environment_factory, hp.tools, hp.invalid_tool_call, max_chars)
    settings = EpisodeSettings(hp.max_turns, episode_tokens(hp), hp.tool_timeout_s, hp.episode_timeout_s)
    return EpisodeRunner(settings, spec, tokenizer, stop_token_ids, pad_token_id, hp.environment_workers,
                         hp.environment_memory_gib)
