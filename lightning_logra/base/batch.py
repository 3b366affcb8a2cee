"""What one batch of rollouts is, as tensors, and the padding helpers that build and read it.

Shared by the engines (which produce rollouts), the loss and the KL estimate (which read them); it imports nothing
from the project, so the math never depends on the engines.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch

# The columns of `Rollout.episodes`: turns sampled; tool calls made, of them those that failed (raised, timed out,
# named no tool), and calls that could not be read; the environment's own reward (NaN: none); the seconds its batch
# spent in the environments, shared out over its episodes
EPISODE_COLUMNS = ("turns", "tool_calls", "tool_errors", "invalid_calls", "environment_reward", "environment_s")


@dataclass
class Rollout:
    """n completions per prompt, sample i of prompt j in row j·n + i. Shapes: N = prompts·n, P, C token columns."""

    prompt_ids: torch.Tensor  # (N, P) prompts, left-padded
    prompt_mask: torch.Tensor  # (N, P) 1 on prompt tokens
    completion_ids: torch.Tensor  # (N, C) right-padded after the stop token
    completion_mask: torch.Tensor  # (N, C) 1 on generated tokens, the stop token included
    sampler_logprobs: torch.Tensor  # (N, C) log π_sampler(token | context) at the sampling temperature, 0 on padding
    # (N, C) how many updates reached the engine while it generated, before each token was sampled (in-flight
    # updates: RemoteEngine(in_flight=True)); None: none could (every token drawn with the same weights)
    in_flight_updates: torch.Tensor | None = None
    # (N, C) the loss mask of a multi-turn episode: 1 exactly on the tokens the engine sampled (each turn's stop token
    # included), 0 on what the environment added between turns (tool answers, the chat template's turn markers),
    # which are in completion_ids and completion_mask (the policy reads them) but are not the policy's actions;
    # None: every completion token was sampled (one turn)
    sampled_mask: torch.Tensor | None = None
    # (N, len(EPISODE_COLUMNS)) float: what each multi-turn episode did (turns, tool calls, ...); None: one turn
    episodes: torch.Tensor | None = None

    @property
    def loss_mask(self) -> torch.Tensor:
        """(N, C) 1 on the tokens every token sum counts (the loss, its normalizers, the entropy, the importance ratios,
        the KL estimates): the sampled ones."""
        return self.completion_mask if self.sampled_mask is None else self.sampled_mask

    @property
    def completion_lengths(self) -> torch.Tensor:
        return self.completion_mask.sum(-1)  # (N,)

    def to(self, device: torch.device | str) -> Rollout:
        return Rollout(*(None if (t := getattr(self, f.name)) is None else t.to(device) for f in fields(self)))

    def terminated(self, stop_token_ids: list[int]) -> torch.Tensor:
        """(N,) bool: whether each completion ended with a stop token (the others were cut at the length limit)."""
        lengths = self.completion_lengths
        last = self.completion_ids.gather(1, (lengths - 1).clamp(min=0)[:, None]).squeeze(1)  # (N,)
        return (lengths > 0) & torch.isin(last, torch.as_tensor(stop_token_ids, device=last.device))

    def emptied(self) -> Rollout:
        """The same rows with no token that counts (a pass on them still runs: a rank's idle pass in step with the
        others')."""
        sampled = None if self.sampled_mask is None else torch.zeros_like(self.sampled_mask)
        return replace(self, completion_mask=torch.zeros_like(self.completion_mask), sampled_mask=sampled)

    def select(self, rows: torch.Tensor) -> Rollout:
        """The given rows, with the completion columns that are padding in all of them trimmed off the right (one
        kept where no row has a token that counts: a pass on it still runs)."""
        width = max(1, int(self.completion_mask[rows].sum(-1).max()))
        in_flight, sampled = (None if t is None else t[rows, :width] for t in (self.in_flight_updates,
                                                                             self.sampled_mask))
        episodes = None if self.episodes is None else self.episodes[rows]
        return Rollout(self.prompt_ids[rows], self.prompt_mask[rows], self.completion_ids[rows, :width],
                       self.completion_mask[rows, :width], self.sampler_logprobs[rows, :width], in_flight, sampled,
                       episodes)


def concat(rollouts: list[Rollout]) -> Rollout:
    """The rows of `rollouts`, in order, as one: prompts left-padded and completions right-padded to the widest (padding
    is id 0 under a 0 mask: no position counts it)."""
    prompt_width = max(r.prompt_ids.shape[1] for r in rollouts)
    completion_width = max(r.completion_ids.shape[1] for r in rollouts)

    def padded(t: torch.Tensor | None, width: int, left: bool) -> torch.Tensor | None:
        if t is None:
            return None
        extra = width - t.shape[1]
        return torch.nn.functional.pad(t, (extra, 0) if left else (0, extra))

    in_flight = [r.in_flight_updates for r in rollouts]
    if any(t is not None for t in in_flight):  # rows drawn without in-flight updates saw none
        in_flight = [torch.zeros_like(r.completion_ids) if t is None else t for r, t in zip(rollouts, in_flight)]
    sampled = [r.sampled_mask for r in rollouts]
    if any(t is not None for t in sampled):  # a one-turn row's tokens were all sampled
        sampled = [r.loss_mask for r in rollouts]
    columns = [[padded(getattr(r, name), prompt_width, left=True) for r in rollouts]
               for name in ("prompt_ids", "prompt_mask")]
    columns += [[padded(t, completion_width, left=False) for t in ts] for ts in (
        [r.completion_ids for r in rollouts], [r.completion_mask for r in rollouts],
        [r.sampler_logprobs for r in rollouts], in_flight, sampled)]
    episodes = [r.episodes for r in rollouts]
    if any(t is not None for t in episodes):  # a one-turn row: one turn, nothing else
        one_turn = torch.tensor([1.0, 0, 0, 0, math.nan, 0])
        episodes = [one_turn.expand(len(r.completion_ids), -1) if t is None else t for r, t in zip(rollouts, episodes)]
    columns.append(episodes)
    return Rollout(*(None if parts[0] is None else torch.cat(parts) for parts in columns))


def left_pad(sequences: list[list[int]], pad_id: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask), each (len(sequences), longest): sequences right-aligned so that generation appends on the right."""
    width = max((len(s) for s in sequences), default=0)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        if seq:
            ids[row, width - len(seq) :] = torch.tensor(seq)
            mask[row, width - len(seq) :] = 1
    return ids.to(device), mask.to(device)


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids that ignore left padding: 0 at each row's first real token."""
    return (mask.cumsum(-1) - 1).clamp(min=0)
