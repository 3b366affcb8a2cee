"""The embedded task (splits, answers, tokenizer) and the tiny model shipped for it."""

import re

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_logra.data.arith import (
    ARITH_VOCAB,
    EVAL_SIZE,
    TINY_ARITH_DIR,
    ArithPrompts,
    build_tokenizer,
    make_examples,
    reversed_sum,
)


def _pairs(examples: list[dict[str, str]]) -> set[tuple[int, int]]:
    return {tuple(int(x) for x in ex["prompt"].rstrip("=").split("+")) for ex in examples}


def test_splits_are_disjoint_cover_every_pair_and_never_change():
    train, evaluation = make_examples("train"), make_examples("eval")
    assert len(evaluation) == EVAL_SIZE and len(train) == 90 * 90 - EVAL_SIZE
    assert not _pairs(train) & _pairs(evaluation)
    assert _pairs(train) | _pairs(evaluation) == {(a, b) for a in range(10, 100) for b in range(10, 100)}
    assert make_examples("train") == train and make_examples("eval") == evaluation
    # Pinned: the split comes from random.Random(0), so these are the same on every machine and Python 3 version.
    # Changing them means every reported eval number stops being comparable.
    assert [ex["prompt"] for ex in evaluation[:3]] == ["10+26=", "10+34=", "10+45="]


def test_answers_are_reversed_sums():
    assert reversed_sum(12, 34) == "64"  # 46 reversed
    assert reversed_sum(57, 68) == "521"  # 125 reversed
    assert reversed_sum(50, 50) == "001"  # 100 reversed keeps its zeros: they are the digits the model must write
    for ex in make_examples("train") + make_examples("eval"):
        a, b = (int(x) for x in ex["prompt"].rstrip("=").split("+"))
        assert int(ex["answer"][::-1]) == a + b and re.fullmatch(r"\d{2,3}", ex["answer"])


def test_dataset_serves_plain_dicts():
    dataset = ArithPrompts("eval")
    assert len(dataset) == EVAL_SIZE
    assert dataset[0] == {"prompt": "10+26=", "answer": "63"}


def test_tokenizer_is_character_level_with_pad_and_eos():
    tokenizer = build_tokenizer()
    assert len(tokenizer) == len(ARITH_VOCAB)
    assert tokenizer.pad_token == "<pad>" and tokenizer.eos_token == "<eos>"
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert tokenizer.padding_side == "left"
    ids = tokenizer("12+34=64<eos>").input_ids
    assert len(ids) == 9 and ids[-1] == tokenizer.eos_token_id  # one token per character, <eos> as one token
    assert tokenizer.decode(ids) == "12+34=64<eos>"
    assert tokenizer.decode(ids, skip_special_tokens=True) == "12+34=64"
    padded = tokenizer(["12+34=", "1+2="], padding=True).input_ids
    assert padded[1][:2] == [tokenizer.pad_token_id] * 2  # left padding


def test_shipped_model_loads_and_answers_with_digits():
    tokenizer = AutoTokenizer.from_pretrained(TINY_ARITH_DIR)
    model = AutoModelForCausalLM.from_pretrained(TINY_ARITH_DIR).eval()
    config = model.config
    assert config.hidden_size // config.num_attention_heads == 64  # vLLM's CPU attention needs head_dim 64
    assert config.tie_word_embeddings and config.vocab_size == len(tokenizer)
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert sum(f.stat().st_size for f in TINY_ARITH_DIR.iterdir()) < 5 * 2**20
    # transformers 5 loads a qwen2 folder's tokenizer as Qwen2Tokenizer, rebuilt from the saved vocabulary; it must
    # still give the ids the model was trained on.
    text = "57+68=521<eos>"
    assert tokenizer(text).input_ids == build_tokenizer()(text).input_ids

    inputs = tokenizer(["12+34="], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=4)  # (1, 6 + up to 4)
    completion = out[0, inputs.input_ids.shape[1] :].tolist()
    assert tokenizer.eos_token_id in completion
    answer = tokenizer.decode(completion[: completion.index(tokenizer.eos_token_id)])
    assert re.fullmatch(r"\d{2,3}", answer), answer
