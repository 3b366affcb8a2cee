"""What both vLLM engines (`VLLMEngine` in the trainer's processes, `RemoteEngine` through a server) make of vLLM's
requests and answers: the seed a request may carry, the samples as a `Rollout`, the workers' blocks as whole tensors."""

from __future__ import annotations

import torch

from lightning_logra.base.batch import Rollout, left_pad

SEED_MASK = (1 << 62) - 1  # vLLM gives sample i of a request the seed (seed + i): keep clear of int64 overflow


def samples_to_rollout(prompt_ids: list[list[int]], n: int, completions: list[list[int]],
                       logprobs: list[list[float]], pad_token_id: int) -> Rollout:
    """The n completions of each prompt (tokens, ending with the stop token, and the sampler's log-probs) as a batch."""
    prompt, prompt_mask = left_pad([p for p in prompt_ids for _ in range(n)], pad_token_id, "cpu")
    width = max(1, max((len(c) for c in completions), default=0))
    ids = torch.full((len(completions), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(completions), width), dtype=torch.long)
    sampler = torch.zeros((len(completions), width), dtype=torch.float32)
    for row, (tokens, lps) in enumerate(zip(completions, logprobs)):
        ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        mask[row, : len(tokens)] = 1  # vLLM's output keeps the stop token, as the trainer's convention does
        sampler[row, : len(lps)] = torch.tensor(lps, dtype=torch.float32)
    return Rollout(prompt, prompt_mask, ids, mask, sampler)


def assemble_blocks(blocks: dict[str, torch.Tensor], add_columns: bool) -> dict[str, torch.Tensor]:
    """Put workers' blocks keyed "name|row|col" back together: blocks of rows side by side; blocks of columns
    side by side (`add_columns=False`, whole weights) or summed (`add_columns=True`, fingerprints W[:, cols]·v)."""
    by_name: dict[str, list[tuple[int, int, torch.Tensor]]] = {}
    for key, block in blocks.items():
        name, row, col = key.rsplit("|", 2)
        by_name.setdefault(name, []).append((int(row), int(col), block))
    out = {}
    for name, parts in by_name.items():
        rows = max(r + b.shape[0] for r, _, b in parts)
        if parts[0][2].dim() == 1:
            full = torch.zeros(rows, dtype=parts[0][2].dtype)
            for r, _, b in parts:
                if add_columns:
                    full[r : r + b.shape[0]] += b
                else:
                    full[r : r + b.shape[0]] = b
        else:
            cols = max(c + b.shape[1] for _, c, b in parts)
            full = torch.zeros(rows, cols, dtype=parts[0][2].dtype)
            for r, c, b in parts:
                full[r : r + b.shape[0], c : c + b.shape[1]] = b
        out[name] = full
    return out
