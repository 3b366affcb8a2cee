import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lightning_logra.data.prompts import PromptDataset

# Rows shaped like BytedTsinghua-SIA/DAPO-Math-17k (prompt as a chat, gold under reward_model.ground_truth).
DAPO_ROWS = [
    {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": f"Solve: {a} + {a}.\n\nAnswer: $Answer"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": str(2 * a), "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": f"id-{a}"},
    }
    for a in (1, 2, 3)
]

# Rows shaped like HuggingFaceH4/MATH-500.
MATH500_ROWS = [
    {"problem": r"What is $\frac{1}{2} + \frac{1}{4}$?", "solution": r"... $\boxed{\frac{3}{4}}$",
     "answer": r"\frac{3}{4}", "subject": "Prealgebra", "level": 1, "unique_id": "test/prealgebra/1.json"},
    {"problem": r"Simplify $\sqrt{8}$.", "solution": r"... $\boxed{2\sqrt{2}}$",
     "answer": r"2\sqrt{2}", "subject": "Algebra", "level": 2, "unique_id": "test/algebra/2.json"},
]


def write_rows(path, rows):
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_dapo_math_preset(tmp_path, suffix):
    path = write_rows(tmp_path / f"dapo{suffix}", DAPO_ROWS)
    dataset = PromptDataset(str(path), preset="dapo_math")
    assert len(dataset) == 3
    item = dataset[1]
    # The user message's text, not the chat: the trainer applies the chat template.
    assert item["prompt"] == "Solve: 2 + 2.\n\nAnswer: $Answer"
    assert item["answer"] == "4"
    # Every other column is kept for the reward function.
    assert item["data_source"] == "math_dapo"
    assert item["extra_info"] == {"index": "id-2"}
    assert item["reward_model"]["ground_truth"] == "4"


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_math500_preset(tmp_path, suffix):
    path = write_rows(tmp_path / f"math500{suffix}", MATH500_ROWS)
    dataset = PromptDataset(str(path), preset="math500")
    assert [item["prompt"] for item in dataset] == [row["problem"] for row in MATH500_ROWS]
    assert [item["answer"] for item in dataset] == [r"\frac{3}{4}", r"2\sqrt{2}"]
    assert dataset[0]["level"] == 1 and dataset[0]["solution"].endswith(r"\boxed{\frac{3}{4}}$")


def test_column_mapping_and_nested_keys_without_a_preset(tmp_path):
    math500 = write_rows(tmp_path / "m.jsonl", MATH500_ROWS)
    assert PromptDataset(str(math500), prompt_key="problem")[1]["prompt"] == r"Simplify $\sqrt{8}$."
    dapo = write_rows(tmp_path / "d.parquet", DAPO_ROWS)
    dataset = PromptDataset(str(dapo), answer_key="reward_model.ground_truth")
    assert (dataset[0]["prompt"], dataset[0]["answer"]) == ("Solve: 1 + 1.\n\nAnswer: $Answer", "2")
    # An explicit key wins over the preset's.
    assert PromptDataset(str(dapo), preset="dapo_math", answer_key="extra_info.index")[0]["answer"] == "id-1"


def test_plain_rows_with_numeric_answers(tmp_path):
    path = write_rows(tmp_path / "plain.jsonl", [{"prompt": "1+1=", "answer": 2}])
    assert PromptDataset(str(path))[0] == {"prompt": "1+1=", "answer": "2"}


def test_template_keeps_other_braces(tmp_path):
    path = write_rows(tmp_path / "m.jsonl", MATH500_ROWS)
    template = "{prompt}\nPut your final answer within \\boxed{}."
    dataset = PromptDataset(str(path), preset="math500", template=template)
    assert dataset[1]["prompt"] == "Simplify $\\sqrt{8}$.\nPut your final answer within \\boxed{}."


def test_limit(tmp_path):
    for suffix in (".jsonl", ".parquet"):
        path = write_rows(tmp_path / f"d{suffix}", DAPO_ROWS)
        assert [item["answer"] for item in PromptDataset(str(path), preset="dapo_math", limit=2)] == ["2", "4"]


def test_hub_names_go_through_load_dataset(monkeypatch):
    datasets = pytest.importorskip("datasets")
    calls = []

    def fake_load_dataset(name, split):
        calls.append((name, split))
        return datasets.Dataset.from_list(MATH500_ROWS)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    dataset = PromptDataset("HuggingFaceH4/MATH-500", preset="math500", split="test", limit=1)
    assert calls == [("HuggingFaceH4/MATH-500", "test")]
    assert len(dataset) == 1 and dataset[0]["answer"] == r"\frac{3}{4}"


def test_missing_file(tmp_path):
    path = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="prompt file not found: .*nope.jsonl"):
        PromptDataset(str(path))


def test_missing_column_names_it_and_lists_the_columns(tmp_path):
    path = write_rows(tmp_path / "m.jsonl", MATH500_ROWS)
    # MATH-500 has no "prompt" column: the default prompt_key fails and says what to use instead.
    with pytest.raises(ValueError, match=r"prompt_key='prompt': no column 'prompt' in row 0 of .*m.jsonl; available: "
                                         r"\['answer', 'level', 'problem', 'solution', 'subject', 'unique_id'\]"):
        PromptDataset(str(path))


def test_missing_nested_column(tmp_path):
    path = write_rows(tmp_path / "d.jsonl", DAPO_ROWS)
    with pytest.raises(ValueError, match=r"answer_key='reward_model.answer': no column 'answer' under 'reward_model' "
                                         r"in row 0 .*; available: \['ground_truth', 'style'\]"):
        PromptDataset(str(path), answer_key="reward_model.answer")
    with pytest.raises(ValueError, match=r"'data_source' in row 0 .* is a str, not a mapping"):
        PromptDataset(str(path), preset="dapo_math", answer_key="data_source.x")


def test_chat_without_a_user_message(tmp_path):
    path = write_rows(tmp_path / "c.jsonl", [{"prompt": [{"role": "system", "content": "hi"}], "answer": "1"}])
    with pytest.raises(ValueError, match="no {'role': 'user', ...} message"):
        PromptDataset(str(path))


def test_empty_dataset(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(ValueError, match="has no rows"):
        PromptDataset(str(path))


def test_bad_arguments(tmp_path):
    path = write_rows(tmp_path / "m.jsonl", MATH500_ROWS)
    with pytest.raises(ValueError, match=r"template 'Q: \{question\}' has no '\{prompt\}' placeholder"):
        PromptDataset(str(path), preset="math500", template="Q: {question}")
    with pytest.raises(ValueError, match=r"unknown preset 'gsm8k'; known presets: \['dapo_math', 'math500'\]"):
        PromptDataset(str(path), preset="gsm8k")


def test_invalid_jsonl_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": \n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        PromptDataset(str(path))


def test_rows_with_other_columns_fail_when_loaded_naming_the_row(tmp_path):
    # A batch that mixed these rows would fail in collate_rows with a bare KeyError, possibly late in a run.
    rows = [{"prompt": "1+1", "answer": "2", "level": 1}, {"prompt": "2+2", "answer": "4", "level": 2},
            {"prompt": "3+3", "answer": "6", "source": "x"}]
    path = write_rows(tmp_path / "mixed.jsonl", rows)
    with pytest.raises(ValueError, match=r"row 2 of .*mixed.jsonl has other columns than row 0: missing \['level'\], "
                                         r"extra \['source'\]\. Every row needs the same columns"):
        PromptDataset(str(path))
