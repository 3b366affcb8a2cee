"""DAPO's soft over-long penalty as a reward: nothing for a completion of up to `max_length − buffer` tokens, then a
penalty growing linearly to −1 at `max_length`, and −1 past it. Combined with a correctness reward through
`model.scoring.weights` (verl's `reward_model.overlong_buffer`, whose `penalty_factor` is the weight here; TRL's
`get_soft_overlong_punishment(max_completion_len, soft_punish_cache)`). `reward/OverlongPenalty/mean` logs the
mean penalty."""

from __future__ import annotations

from lightning_logra.base.settings import check_positive


class OverlongPenalty:
    """For a config::

        reward:
          - math_answer
          - class_path: lightning_logra.rewards.OverlongPenalty
            init_args: {max_length: 1024, buffer: 256}
        reward_weights: [1.0, 1.0]

    Args:
        max_length: the length, in completion tokens (its stop token included), that scores −1; usually
            model.sampling.max_new_tokens, which no completion can pass.
        buffer: the tokens before max_length over which the penalty grows from 0 to −1 (DAPO's L_cache).
    """

    def __init__(self, max_length: int, buffer: int) -> None:
        check_positive("model.reward: OverlongPenalty's max_length", max_length, "number of tokens", integer=True)
        check_positive("model.reward: OverlongPenalty's buffer", buffer, "number of tokens", integer=True)
        if buffer > max_length:
            raise ValueError(f"model.reward: OverlongPenalty's buffer={buffer} is longer than its "
                             f"max_length={max_length}: the penalty starts at max_length − buffer tokens")
        self.max_length, self.buffer = max_length, buffer

    def __call__(self, prompts: list, completions: list, completion_ids: list[list[int]], **_: object) -> list[float]:
        free = self.max_length - self.buffer
        return [0.0 if len(ids) <= free else max(-1.0, (free - len(ids)) / self.buffer) for ids in completion_ids]

    def __repr__(self) -> str:
        return f"OverlongPenalty(max_length={self.max_length}, buffer={self.buffer})"
