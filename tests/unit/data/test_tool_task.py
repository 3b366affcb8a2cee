"""The embedded multi-turn task (lightning_logra/data/tool_task.py): prompts and answers, the held-out split, the
tool, the data module, and the shipped model's files."""

import json

import torch
from transformers import AutoTokenizer

from lightning_logra.data.module import ToolTaskDataModule
from lightning_logra.data.tool_task import (
    CHAT_TEMPLATE,
    TOOLS_DIR,
    ToolPrompts,
    build_tool_tokenizer,
    multiply,
    operands,
)


def test_prompts_are_products_of_three_digit_numbers():
    assert operands(0) == (100, 100) and operands(810_000 - 1) == (999, 999)
    assert multiply(123, 456) == 56088
    held_out = ToolPrompts("eval")
    assert held_out[0] == {"prompt": "444*651=", "answer": "289044"}  # index 310,151
    assert held_out.longest_prompt() == "444*651="  # every prompt has 8 characters


def test_the_held_out_split_is_fixed_disjoint_and_large_enough():
    held_out, train = ToolPrompts("eval"), ToolPrompts("train")
    assert len(held_out) == 1993 and len(train) == 808_007
    both = torch.cat([held_out.indices, train.indices]).sort().values
    assert torch.equal(both, torch.arange(810_000))  # every pair in exactly one split
    # the same split, in the same order, on every machine (hashes): a limit takes pairs of every operand
    assert held_out.indices[:3].tolist() == [310_151, 686_363, 798_217]
    assert sorted(held_out.indices.tolist())[:3] == [183, 1822, 1831] and train.indices[:2].tolist() == [0, 1]
    first = ToolPrompts("eval", limit=100)
    assert len(first) == 100 and len({first[i]["prompt"][0] for i in range(100)}) == 9  # a's first digit: 1-9


def test_the_data_module_serves_both_splits():
    data = ToolTaskDataModule(batch_size=4, eval_batch_size=8, eval_limit=10)
    data.setup("fit")
    assert len(data.train_set) == 808_007 and len(data.eval_sets["validate"]) == 10
    held_out = {data.eval_sets["validate"][i]["prompt"] for i in range(10)}
    assert not held_out & {data.train_set[i]["prompt"] for i in range(0, 808_007, 997)}


def test_the_template_renders_a_call_and_its_answer_token_for_token():
    tokenizer = build_tool_tokenizer()
    call = '<tool_call>{"name": "multiply", "arguments": {"a": 123, "b": 456}}</tool_call>'
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "123*456="}, {"role": "assistant", "content": call},
         {"role": "tool", "content": "56088"}], tokenize=False, add_generation_prompt=True)
    assert text == f"<u>123*456=<a>{call}<eos><t>56088<a>"
    ids = tokenizer.encode(call, add_special_tokens=False)
    assert len(ids) == 57 and tokenizer.decode(ids) == call  # 55 characters and two tags, kept by decoding


def test_the_shipped_model_is_small_and_has_the_tool_template():
    files = {f.name: f.stat().st_size for f in TOOLS_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= files.keys()
    assert sum(files.values()) < 4 * 1024 * 1024  # a few MB at most
    assert AutoTokenizer.from_pretrained(TOOLS_DIR).chat_template == CHAT_TEMPLATE
    assert json.loads((TOOLS_DIR / "generation_config.json").read_text())["max_new_tokens"] == 64
