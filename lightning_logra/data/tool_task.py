"""A character-level tokenizer with a chat template that renders tool calls and answers (Hermes style, as Qwen's):
what the tiny models of multi-turn episodes read, and the calculator environment they talk to.

The template keeps every turn as it was (prefix-preserving): a user turn is `<u>text`, an assistant turn `<a>text<eos>`
(a tool call inside it as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), a tool's answer `<t>text`, and
the generation prompt `<a>`. `<tool_call>` and `</tool_call>` are single tokens that decoding keeps (not special), so
a turn's text shows its calls.
"""

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

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


class Calculator:
    """The environment of the calculator task: one tool, exact products of whole numbers."""

    def reset(self, **row) -> None:
        return None

    def multiply(self, a: int, b: int) -> int:
        """The product of two whole numbers.

        Args:
            a: the first factor
            b: the second factor
        """
        return int(a) * int(b)
