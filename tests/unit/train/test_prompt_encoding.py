"""Prompts as the engine receives them: a conversation that ends with an assistant message is that message begun
(the template renders it open, TRL's `continue_final_message`), any other gets the generation prompt."""

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from lightning_logra.train.policy import encode_prompts

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} </> {% endfor %}"
            "{% if add_generation_prompt %}<assistant> {% endif %}")


def _tokenizer() -> PreTrainedTokenizerFast:
    words = ["<user>", "<assistant>", "</>", "2+3", "<answer>", "ok"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", *words])}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def test_a_conversation_ending_with_the_assistant_is_continued_and_others_get_the_generation_prompt():
    tokenizer = _tokenizer()
    asked = [{"role": "user", "content": "2+3"}]
    begun = [*asked, {"role": "assistant", "content": "<answer>"}]
    ids = encode_prompts(tokenizer, [asked, begun, "2+3"], chat_template=True)
    assert [tokenizer.convert_ids_to_tokens(row) for row in ids] == [
        ["<user>", "2+3", "</>", "<assistant>"],
        ["<user>", "2+3", "</>", "<assistant>", "<answer>"],  # open: no end marker, no second generation prompt
        ["<user>", "2+3", "</>", "<assistant>"],
    ]
