"""The harder embedded task: 3-digit addition written least significant digit first (`add3`).

Both operands and the answer are reversed: 123 + 456 = 579 is the prompt ``"321+654="`` and the completion ``"975"``
(999 + 999 = 1998: ``"999+999="`` → ``"8991"``). It is the 2-digit task of `arith.py` one digit longer:

- **learnable**: written this way, output digit i is (a_i + b_i + carry) mod 10, where a_i and b_i sit at the same
  distance before the writing position for every i (7 and 3 tokens back) and the carry follows from the digits of
  the previous position; nothing depends on a digit not yet produced. A partially trained model gets many answers
  right, so a group of 8 samples often holds a right and a wrong one, and binary rewards give a signal. (With only
  the answer reversed, the distances differ per digit, and this model learns the tens digit last: supervised
  training sat for over 3,500 steps at greedy pass@1 ≈ 0.1 with the tens at chance, where RL found no signal.)
- **hard**: an answer is right only if all 3–4 digits are, and a carry may run through two positions (the middle
  digit depends on the carry out of the units). Per-digit errors multiply (85% per digit is ~55% per answer), and
  810,000 operand pairs cannot be memorized.

The operand pairs are split by a hash of the pair index (SplitMix64, the same on every machine): about one pair in
400, 2,054 in all, is held out for evaluation (the `eval` split; greedy pass@1 on 2,054 items has a standard error of
at most 0.011), the other 807,946 are the train split. The model shipped for it (`ADD3_DIR`, made by
`scripts/make_add3.py`) uses the tokenizer and architecture of `arith.py`.
"""

from pathlib import Path

import torch
from torch.utils.data import Dataset

from lightning_logra.base.hashing import hash_split

ADD3_DIR: Path = Path(__file__).resolve().parent / "add3"

MAX_NEW_TOKENS = 5  # the longest answer, 4 digits, plus <eos>
PROMPT_LEN = 8  # "123+456=": every prompt has this length
_LOW, _HIGH = 100, 1000  # operands 100..999
_PAIRS = (_HIGH - _LOW) ** 2  # 810,000
_EVAL_ONE_IN = 400  # a pair is held out when the hash of its index is 0 modulo this
_SPLIT_SALT = 0x5EED_ADD3


def reversed_sum(a: int, b: int) -> str:
    """The correct completion for the pair (a, b): the digits of a + b, least significant first."""
    return str(a + b)[::-1]


def split_indices(split: str) -> torch.Tensor:
    """The indices (int64, ascending) of the operand pairs in `split`; index i is the pair (100 + i // 900,
    100 + i % 900)."""
    return hash_split(_PAIRS, split, _SPLIT_SALT, _EVAL_ONE_IN)


def example(index: int) -> dict[str, str]:
    a, b = _LOW + index // (_HIGH - _LOW), _LOW + index % (_HIGH - _LOW)
    return {"prompt": f"{str(a)[::-1]}+{str(b)[::-1]}=", "answer": reversed_sum(a, b)}  # 123, 456: "321+654="


class Add3Prompts(Dataset):
    """A map-style dataset of ``{"prompt", "answer"}`` dicts over one split, made on demand from the pair index (the
    train split has 807,946 pairs: no list of dicts is built)."""

    def __init__(self, split: str = "train", limit: int | None = None) -> None:
        self.split = split
        self.indices = split_indices(split)[:limit]  # (n,)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> dict[str, str]:
        return example(int(self.indices[index]))

    def longest_prompt(self) -> str:
        return example(int(self.indices[0]))["prompt"]  # every prompt has PROMPT_LEN characters
