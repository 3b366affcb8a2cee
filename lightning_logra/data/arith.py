"""The embedded default task: 2-digit addition with the answer written reversed.

A prompt is ``"12+34="`` and the correct completion is the sum with its least significant digit first
(12+34=46 → ``"64"``, 57+68=125 → ``"521"``). Reversed answers make the task learnable by a tiny causal LM:
each digit depends only on the operand digits at its position and the carry from the digit just written, so the
model never has to look ahead to a carry it has not produced yet.

The project ships a small Qwen2 model trained only part of the way on the train split (``TINY_ARITH_DIR``, made by
``scripts/make_tiny_arith.py``), so that RL on a laptop starts from a partial reward it can visibly raise.
"""

import random
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from torch.utils.data import Dataset
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

# Token ids are the positions in this list; the special tokens come first so that their ids stay fixed (pad = 0,
# eos = 1, unk = 2) whatever the task's characters are. There is no <bos>: every prompt has the same shape, so
# nothing needs to mark a sequence start (Qwen2 models have no bos either). <unk> is here because transformers 5
# loads any qwen2 model folder's tokenizer as Qwen2Tokenizer, which adds an "<|endoftext|>" unk token beyond the
# model's vocabulary unless the saved tokenizer names an unk token of its own.
ARITH_VOCAB: list[str] = ["<pad>", "<eos>", "<unk>", *"0123456789", "+", "="]

TINY_ARITH_DIR: Path = Path(__file__).resolve().parent / "tiny_arith"

EVAL_SIZE = 500
MAX_NEW_TOKENS = 4  # the longest answer, 3 digits, plus <eos>
_SPLIT_SEED = 0
_OPERANDS = range(10, 100)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer over the task's characters; any other character becomes <unk>."""
    vocab = {token: i for i, token in enumerate(ARITH_VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    # Every character is its own word, so "12+34=" becomes six tokens.
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    # Join tokens without the spaces WordLevel would otherwise put between them.
    tokenizer.decoder = decoders.Fuse()
    # Registered as special so that "<eos>" in text is one token rather than five characters.
    tokenizer.add_special_tokens(["<pad>", "<eos>", "<unk>"])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        # Generation appends to the right end of each row, so prompts of unequal length are padded on the left.
        padding_side="left",
    )


def reversed_sum(a: int, b: int) -> str:
    """The correct completion for ``f"{a}+{b}="``: the digits of a + b, least significant first."""
    return str(a + b)[::-1]


def make_examples(split: str) -> list[dict[str, str]]:
    """All 90 × 90 operand pairs of 10..99, split once by a seeded shuffle into ``EVAL_SIZE`` eval pairs and the
    rest train. ``random.Random(seed).shuffle`` is the same on every machine and Python 3 version, unlike ``hash``.
    Each split is returned in operand order."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    pairs = [(a, b) for a in _OPERANDS for b in _OPERANDS]
    random.Random(_SPLIT_SEED).shuffle(pairs)
    chosen = pairs[:EVAL_SIZE] if split == "eval" else pairs[EVAL_SIZE:]
    return [{"prompt": f"{a}+{b}=", "answer": reversed_sum(a, b)} for a, b in sorted(chosen)]


class ArithPrompts(Dataset):
    """A map-style dataset of ``{"prompt", "answer"}`` dicts over one split; the trainer collates lists of them."""

    def __init__(self, split: str = "train") -> None:
        self.split = split
        self.examples = make_examples(split)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict[str, str]:
        return self.examples[index]

    def longest_prompt(self) -> str:
        return max((example["prompt"] for example in self.examples), key=len)


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast, num_hidden_layers: int = 4, intermediate_size: int = 384,
    max_new_tokens: int = MAX_NEW_TOKENS, max_position_embeddings: int = 32,
) -> Qwen2ForCausalLM:
    """The shipped models' architecture with random weights (tests use a smaller depth and MLP; the 3-digit task of
    `add3.py` answers in up to `max_new_tokens` = 5 tokens; episodes with tools need a longer context)."""
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        # head_dim = 128 / 2 = 64: vLLM's CPU attention kernels reject small head sizes such as 16.
        num_attention_heads=2,
        num_key_value_heads=2,
        num_hidden_layers=num_hidden_layers,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        # The task has no <bos>; like Qwen2's own configs, bos points at eos so that nothing reads an unset id.
        bos_token_id=tokenizer.eos_token_id,
        dtype="float32",
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id,
        max_new_tokens=max_new_tokens,
    )
    return model
