"""How long a prompt may be: the model's context less the room its completions take."""

from __future__ import annotations

from torch import nn

from lightning_logra.rollout import RolloutEngine


def prompt_token_limit(stage: str, engine: RolloutEngine | None, policy: nn.Module, new_tokens: int,
                       eval_max_new_tokens: int | None, episode_tokens: int | None) -> tuple[int, str] | None:
    """The longest prompt, in tokens, that leaves room in the model's context for the completions of `stage`
    ("fit": `new_tokens` is model.sampling.max_new_tokens; "validate", "test": the evaluation's; an episode's
    `episode_tokens` when set), with where the limit comes from (for the data module's messages). The context is the
    engine's max_model_len when set, else the policy's max_position_embeddings; None when neither states one. The
    data module asks for it when data.max_prompt_length is unset: a prompt past the context would grow generation's
    memory without bound."""
    max_model_len = engine.max_model_len() if engine is not None else None
    if max_model_len is not None:
        context, context_key, longer = max_model_len, "model.rollouts.engine's max_model_len", "raise it"
    else:
        context = getattr(policy.config, "max_position_embeddings", None)
        context_key, longer = "model.model's max_position_embeddings", "use a model with a longer one"
        if context is None:  # a model without a fixed context (state-space models)
            return None
    evaluating = stage != "fit" and eval_max_new_tokens is not None
    new_tokens_key = "model.evaluation.max_new_tokens" if evaluating else "model.sampling.max_new_tokens"
    if episode_tokens:  # an episode's turns and answers follow the prompt
        new_tokens_key, new_tokens = "model.episodes.max_tokens", episode_tokens
    if context - new_tokens < 1:
        raise ValueError(f"{new_tokens_key}={new_tokens} leaves no room for a prompt in the model's context of "
                         f"{context} tokens ({context_key}): set {new_tokens_key} below {context}, or {longer}")
    return context - new_tokens, f"{context_key}={context}, less {new_tokens_key}={new_tokens}"
