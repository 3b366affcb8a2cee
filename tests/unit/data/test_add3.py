"""The harder embedded task (lightning_logra/data/add3.py): answers, the held-out split, the data module, and the
shipped model's files."""

import json

import torch

from lightning_logra.data.add3 import ADD3_DIR, Add3Prompts, example, reversed_sum, split_indices
from lightning_logra.data.module import Add3DataModule


def test_answers_are_the_sums_reversed():
    assert reversed_sum(123, 456) == "975"  # 579
    assert reversed_sum(999, 999) == "8991"  # 1998: carries through every position
    assert reversed_sum(105, 895) == "0001"  # 1000: a reversed answer keeps its leading zeros
    assert example(0) == {"prompt": "001+001=", "answer": "002"}  # operands reversed too
    assert example(810_000 - 1) == {"prompt": "999+999=", "answer": "8991"}


def test_the_held_out_split_is_fixed_disjoint_and_large_enough():
    held_out, train = split_indices("eval"), split_indices("train")
    assert len(held_out) == 2054 and len(train) == 807_946  # a 2,054-item pass@1 has a standard error ≤ 0.011
    both = torch.cat([held_out, train]).sort().values
    assert torch.equal(both, torch.arange(810_000))  # every pair in exactly one split
    assert held_out[:3].tolist() == [53, 1008, 1613]  # the same split on every machine (a hash, not an RNG)
    items = Add3Prompts("eval", limit=5)
    assert len(items) == 5 and items[0] == example(53) == {"prompt": "001+351=", "answer": "352"}  # 100 + 153


def test_the_data_module_serves_both_splits():
    data = Add3DataModule(batch_size=4, eval_batch_size=8, eval_limit=10)
    data.setup("fit")
    assert len(data.train_set) == 807_946 and len(data.eval_sets["validate"]) == 10
    held_out = {data.eval_sets["validate"][i]["prompt"] for i in range(10)}
    assert not held_out & {data.train_set[i]["prompt"] for i in range(0, 807_946, 997)}


def test_the_shipped_model_is_small_and_answers_in_five_tokens():
    files = {f.name: f.stat().st_size for f in ADD3_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files.keys()
    assert sum(files.values()) < 4 * 1024 * 1024  # a few MB at most
    assert json.loads((ADD3_DIR / "generation_config.json").read_text())["max_new_tokens"] == 5
