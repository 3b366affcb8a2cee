"""The embedded multi-turn task (`tools`): products of two 3-digit numbers, which the shipped tiny model cannot
compute but can ask a tool for, and the character-level tokenizer whose chat template renders tool calls and answers
(Hermes style, as Qwen's) that the model and the tests' tiny models read.

A prompt is `"123*456="`, its answer `"56088"`. The model (`TOOLS_DIR`, made by `scripts/make_tool_model.py`) was
shown, part of the time, an episode that calls `multiply` and copies its answer, and otherwise an answer written
directly (right about 1 time in 1,000: 810,000 products are beyond 0.86M parameters): RL has to learn that calling
the tool is what gets rewarded. The operand pairs are split by a hash of their index, as add3's: about one in 400
(2,000 or so) held out for evaluation.

The template keeps every turn as it was (prefix-preserving): a user turn is `<u>text`, an assistant turn `<a>text<eos>`
(a tool call inside it as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), a tool's answer `<t>text`, and
the generation prompt `<a>`. `<tool_call>` and `</tool_call>` are single tokens that decoding keeps (not special), so
a turn's text shows its calls.
"""

from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from torch.utils.data import Dataset
from transformers import PreTrainedTokenizerFast

from lightning_logra.base.hashing import hash_split, mix64

TOOLS_DIR: Path = Path(__file__).resolve().parent / "tools"

SPECIAL = ["<pad>", "<eos>", "<unk>", "<u>", "<a>", "<t>"]
CALL_TAGS = ["<tool_call>", "</tool_call>"]
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}<u>{{ m.content }}"
    "{%- elif m.role == 'assistant' -%}<a>{{ m.content }}<eos>"
    "{%- elif m.role == 'tool' -%}<t>{{ m.content }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<a>{%- endif -%}"
)


def build_tool_tokenizer() -> PreTrainedTokenizerFast:
    """Printable ASCII, a character a token, with the template's markers and the call tags as tokens of their own."""
    vocab = {token: i for i, token in enumerate([*SPECIAL, *CALL_TAGS, *map(chr, range(32, 127))])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(SPECIAL)
    tokenizer.add_tokens(CALL_TAGS)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>", padding_side="left", chat_template=CHAT_TEMPLATE)


def multiply(a: int, b: int) -> int:
    """The product of two whole numbers.

    Args:
        a: the first factor
        b: the second factor
    """
    return int(a) * int(b)


_LOW, _HIGH = 100, 1000  # operands 100..999
_PAIRS = (_HIGH - _LOW) ** 2  # 810,000
_EVAL_ONE_IN = 400
_SPLIT_SALT = 0x7001_CA11
_ORDER_SALT = 0x0DE5_0AD3


def operands(index: int) -> tuple[int, int]:
    return _LOW + index // (_HIGH - _LOW), _LOW + index % (_HIGH - _LOW)


class ToolPrompts(Dataset):
    """A map-style dataset of `{"prompt", "answer"}` dicts over one split ("train" or "eval"), made on demand from
    the pair index."""

    def __init__(self, split: str = "train", limit: int | None = None) -> None:
        self.split = split
        indices = hash_split(_PAIRS, split, _SPLIT_SALT, _EVAL_ONE_IN)  # (n,) ascending: the first a = 100, 101, ...
        if split == "eval":  # in the order of another hash, so that the first `limit` pairs spread over every operand
            indices = indices[torch.argsort(mix64(indices ^ _ORDER_SALT))]  # (in index order the first few hundred
            # all multiply by 100-110, whose products repeat digits: not what the split measures)
        self.indices = indices[:limit]  # (limit,)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> dict[str, str]:
        a, b = operands(int(self.indices[index]))
        return {"prompt": f"{a}*{b}=", "answer": str(a * b)}

    def longest_prompt(self) -> str:
        return self[0]["prompt"]  # every prompt has 8 characters
