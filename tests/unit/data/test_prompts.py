"""Prompt rows: formats, presets, column mapping, conversations, deduplication, and the step stream over them."""

import logging
import re

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import write_rows
from lightning_logra.data import prompts
from lightning_logra.data.module import PromptDataModule, StepBatchSampler, collate_rows
from lightning_logra.data.prompts import PromptDataset

pytestmark = pytest.mark.usefixtures("hf_cache")

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

SYSTEM = {"role": "system", "content": "Think, then answer."}


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_dapo_math_preset(tmp_path, suffix):
    path = write_rows(tmp_path / f"dapo{suffix}", DAPO_ROWS)
    dataset = PromptDataset(str(path), preset="dapo_math")
    assert len(dataset) == 3
    item = dataset[1]
    # The conversation as it is (TRL's conversational format): the trainer applies the chat template to all of it.
    assert item["prompt"] == [{"role": "user", "content": "Solve: 2 + 2.\n\nAnswer: $Answer"}]
    assert item["answer"] == "4"
    # Every other column is kept for the reward function.
    assert item["data_source"] == "math_dapo"
    assert item["extra_info"] == {"index": "id-2"}
    assert item["reward_model"]["ground_truth"] == "4"


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet", ".csv"])
def test_math500_preset(tmp_path, suffix):
    path = write_rows(tmp_path / f"math500{suffix}", MATH500_ROWS)
    dataset = PromptDataset(str(path), preset="math500")
    assert [item["prompt"] for item in dataset] == [row["problem"] for row in MATH500_ROWS]
    assert [item["answer"] for item in dataset] == [r"\frac{3}{4}", r"2\sqrt{2}"]
    assert dataset[0]["level"] == 1 and dataset[0]["solution"].endswith(r"\boxed{\frac{3}{4}}$")


def test_rows_stay_in_arrow_and_a_batch_is_one_read(tmp_path):
    path = write_rows(tmp_path / "m.parquet", MATH500_ROWS * 3)  # 6 rows, 2 distinct prompts
    dataset = PromptDataset(str(path), preset="math500", deduplicate=False)
    assert isinstance(dataset.rows, datasets.Dataset) and len(dataset) == 6
    # The DataLoader's batched read gives the same rows as reading them one at a time.
    assert dataset.__getitems__([4, 1]) == [dataset[4], dataset[1]]


def test_column_mapping_and_nested_keys_without_a_preset(tmp_path):
    math500 = write_rows(tmp_path / "m.jsonl", MATH500_ROWS)
    assert PromptDataset(str(math500), prompt_key="problem")[1]["prompt"] == r"Simplify $\sqrt{8}$."
    dapo = write_rows(tmp_path / "d.parquet", DAPO_ROWS)
    dataset = PromptDataset(str(dapo), answer_key="reward_model.ground_truth")
    assert (dataset[0]["prompt"][0]["content"], dataset[0]["answer"]) == ("Solve: 1 + 1.\n\nAnswer: $Answer", "2")
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


def test_a_conversation_keeps_its_system_message_and_the_template_wraps_the_last_user_message(tmp_path):
    chat = [SYSTEM, {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "Which base?"},
            {"role": "user", "content": "Ten."}]
    path = write_rows(tmp_path / "c.parquet", [{"prompt": chat, "answer": "4"}])
    assert PromptDataset(str(path))[0]["prompt"] == chat
    wrapped = PromptDataset(str(path), template="{prompt} Box it.")[0]["prompt"]
    assert wrapped == [*chat[:3], {"role": "user", "content": "Ten. Box it."}]


def test_limit(tmp_path):
    for suffix in (".jsonl", ".parquet"):
        path = write_rows(tmp_path / f"d{suffix}", DAPO_ROWS)
        assert [item["answer"] for item in PromptDataset(str(path), preset="dapo_math", limit=2)] == ["2", "4"]


def test_repeated_prompts_are_dropped_keeping_the_first_of_each_in_order(tmp_path, caplog):
    # Like DAPO-Math-17k, whose 1.79M rows are ~17k prompts repeated: the copies differ in other columns.
    rows = [{**row, "extra_info": {"index": f"copy-{copy}"}} for copy in range(3) for row in DAPO_ROWS]
    rows.insert(1, rows.pop(4))  # a repeat early on: order is by first occurrence, not by sorting
    path = write_rows(tmp_path / "dapo.parquet", rows)
    with caplog.at_level(logging.WARNING, logger="lightning_logra.data.prompts"):
        dataset = PromptDataset(str(path), preset="dapo_math")
    assert [item["answer"] for item in dataset] == ["2", "4", "6"]
    assert [item["extra_info"]["index"] for item in dataset] == ["copy-0", "copy-1", "copy-0"]  # the first of each
    assert "6 of 9 rows repeat an earlier row's prompt and were dropped, 3 prompts left" in caplog.text
    # limit counts distinct prompts; deduplicate: false keeps every row.
    assert len(PromptDataset(str(path), preset="dapo_math", limit=2)) == 2
    assert len(PromptDataset(str(path), preset="dapo_math", deduplicate=False)) == 9


def test_conversations_are_the_same_prompt_only_when_every_message_is(tmp_path):
    rows = [{"prompt": [SYSTEM, {"role": "user", "content": "2+2?"}], "answer": "4"},
            {"prompt": [{"role": "user", "content": "2+2?"}], "answer": "4"},  # no system message: another prompt
            {"prompt": [SYSTEM, {"role": "user", "content": "2+2?"}], "answer": "4"}]
    path = write_rows(tmp_path / "c.jsonl", rows)
    assert [len(item["prompt"]) for item in PromptDataset(str(path))] == [2, 1]


def test_the_step_stream_is_a_function_of_seed_and_step(tmp_path):
    rows = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(20)]
    path = write_rows(tmp_path / "p.jsonl", rows)

    def batches(seed, start, count):
        dataset = PromptDataset(str(path))
        sampler = iter(StepBatchSampler(len(dataset), 4, seed, start))
        return [collate_rows(dataset.__getitems__(next(sampler)))["prompt"] for _ in range(count)]

    from_zero = batches(seed=3, start=0, count=7)
    assert batches(seed=3, start=5, count=2) == from_zero[5:]  # a resumed run sees what an uninterrupted one did
    assert batches(seed=4, start=0, count=7) != from_zero
    # An epoch (5 batches of 4) visits every prompt once.
    assert sorted(p for batch in from_zero[:5] for p in batch) == sorted(row["prompt"] for row in rows)
    module = PromptDataModule(train=str(path), batch_size=4, seed=3)
    module.setup("fit")
    loader = iter(module.train_dataloader())
    assert [next(loader)["prompt"] for _ in range(7)] == from_zero


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"data.train: no such file '.*nope.jsonl'"):
        PromptDataset(str(tmp_path / "nope.jsonl"))


def test_missing_column_names_it_and_lists_the_columns(tmp_path):
    path = write_rows(tmp_path / "m.jsonl", MATH500_ROWS)
    # MATH-500 has no "prompt" column: the default prompt_key fails and says what to use instead.
    with pytest.raises(ValueError, match=r"prompt_key='prompt': no column 'prompt' in data.train \(.*m.jsonl\); "
                                         r"available: \['answer', 'level', 'problem', 'solution', 'subject', "
                                         r"'unique_id'\]"):
        PromptDataset(str(path))


def test_missing_nested_column(tmp_path):
    path = write_rows(tmp_path / "d.jsonl", DAPO_ROWS)
    with pytest.raises(ValueError, match=r"answer_key='reward_model.answer': no column 'answer' under 'reward_model' "
                                         r"in data.train .*; available: \['ground_truth', 'style'\]"):
        PromptDataset(str(path), answer_key="reward_model.answer")
    with pytest.raises(ValueError, match=r"'data_source' in data.train .* is a Value\('string'\), not a mapping"):
        PromptDataset(str(path), preset="dapo_math", answer_key="data_source.x")


def test_a_prompt_column_that_is_neither_text_nor_a_conversation(tmp_path):
    path = write_rows(tmp_path / "n.jsonl", [{"prompt": 12, "answer": "1"}])
    with pytest.raises(ValueError, match=r"prompt_key='prompt' in data.train .* is a Value\('int64'\); expected text "
                                         r"or a conversation"):
        PromptDataset(str(path))


def test_chat_without_a_user_message(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "hi"}], "answer": "1"},
            {"prompt": [{"role": "system", "content": "hi"}], "answer": "1"}]
    path = write_rows(tmp_path / "c.jsonl", rows)
    with pytest.raises(ValueError, match=r"in row 1 of data.train .* is a conversation with no \{'role': 'user', "
                                         r"\.\.\.\} message"):
        PromptDataset(str(path))


def test_null_answers_and_prompts_name_the_row(tmp_path):
    path = write_rows(tmp_path / "n.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": None}])
    with pytest.raises(ValueError, match=r"answer_key='answer' is empty \(null\) in row 1 of data.train"):
        PromptDataset(str(path))
    path = write_rows(tmp_path / "p.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": None, "answer": "2"}])
    with pytest.raises(ValueError, match=r"prompt_key='prompt' is empty \(null\) in row 1 of data.train"):
        PromptDataset(str(path))


def test_empty_dataset(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(ValueError, match=r"data.train: .*corresponds to no data"):
        PromptDataset(str(path))


def test_bad_arguments(tmp_path):
    path = write_rows(tmp_path / "m.jsonl", MATH500_ROWS)
    with pytest.raises(ValueError, match=r"template 'Q: \{question\}' has no '\{prompt\}' placeholder"):
        PromptDataset(str(path), preset="math500", template="Q: {question}")
    with pytest.raises(ValueError, match=r"unknown preset 'gsm8k'; known presets: \['dapo_math', 'math500'\]"):
        PromptDataset(str(path), preset="gsm8k")
    with pytest.raises(ValueError, match="limit must be a positive number of rows"):
        PromptDataset(str(path), preset="math500", limit=0)


def test_invalid_jsonl_line_names_the_file(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": \n')
    with pytest.raises(ValueError, match=r"data.train: .*bad.jsonl: JSON parse error: .* in row 1"):
        PromptDataset(str(path))


def test_empty_prompts_are_dropped_and_counted(tmp_path, caplog):
    rows = [{"prompt": p, "answer": "1"} for p in ["1+1=", "", "2+2=", " \n\t"]]
    with caplog.at_level(logging.WARNING, logger="lightning_logra.data.prompts"):
        dataset = PromptDataset(str(write_rows(tmp_path / "p.jsonl", rows)), config_key="data.val")
    assert [item["prompt"] for item in dataset] == ["1+1=", "2+2="]
    assert re.search(r"data.val \(.*p.jsonl\): 2 of 4 rows have an empty prompt \(prompt_key='prompt': no text, or "
                     r"only whitespace; in a conversation, the last user message\) and were dropped", caplog.text)
    assert "repeat an earlier row" not in caplog.text  # dropped as empty, not counted as repeats of each other


def test_a_conversation_whose_last_user_message_is_empty_is_dropped(tmp_path, caplog):
    asked = [SYSTEM, {"role": "user", "content": "2+2?"}]
    rows = [{"prompt": [SYSTEM, {"role": "user", "content": ""}], "answer": "4"},
            {"prompt": asked, "answer": "4"},
            {"prompt": [*asked, {"role": "assistant", "content": "Which base?"}, {"role": "user", "content": " "}],
             "answer": "4"}]
    with caplog.at_level(logging.WARNING, logger="lightning_logra.data.prompts"):
        dataset = PromptDataset(str(write_rows(tmp_path / "c.parquet", rows)))
    assert [item["prompt"] for item in dataset] == [asked]
    assert "2 of 3 rows have an empty prompt" in caplog.text


def test_a_set_of_empty_prompts_fails_naming_the_key(tmp_path):
    path = write_rows(tmp_path / "p.jsonl", [{"prompt": "", "answer": "1"}, {"prompt": " ", "answer": "2"}])
    with pytest.raises(ValueError, match=r"prompt_key='prompt' is empty \(no text, or only whitespace\) in every row "
                                         r"of data.test \(.*p.jsonl\); point prompt_key at the column"):
        PromptDataset(str(path), config_key="data.test")


# The second row holds bytes that are not UTF-8 (a Latin-1 file, say): JSONL and JSON line 2, CSV line 3 (after the
# header).
NOT_UTF8 = {
    ".jsonl": (b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "caf\xff\xfe", "answer": "3"}\n', 2),
    ".csv": (b'prompt,answer\n1+1=,2\ncaf\xff\xfe,3\n', 3),
    ".json": (b'[{"prompt": "1+1=", "answer": "2"},\n{"prompt": "caf\xff\xfe", "answer": "3"}]', 2),
}


@pytest.mark.parametrize("suffix", sorted(NOT_UTF8))
def test_bytes_that_are_not_utf8_name_the_key_the_file_the_line_and_the_offset(tmp_path, suffix):
    content, line = NOT_UTF8[suffix]
    path = tmp_path / f"latin1{suffix}"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=rf"data.val: .*latin1\{suffix} is not UTF-8 text: line {line} \(byte offset "
                                         rf"{content.index(0xff)}\) has 0xff \(invalid start byte\); save the file as "
                                         "UTF-8"):
        PromptDataset(str(path), config_key="data.val")


@pytest.mark.parametrize("chunk_bytes", [1, 2, 3, 7])
def test_the_offset_is_the_same_whatever_the_chunks_the_file_is_read_in(tmp_path, monkeypatch, chunk_bytes):
    # Two- and three-byte characters before the bad byte: chunks of a few bytes cut them, which must not count. The
    # bad byte starts a Latin-1 "é" that UTF-8 reads as the first of three bytes: a chunk that ends after it holds it.
    content = '{"prompt": "café €", "answer": "1"}\n{"prompt": "b", "answer": "2"}\n'.encode() + b'{"prompt": "\xe9"}\n'
    path = tmp_path / "p.jsonl"
    path.write_bytes(content)
    monkeypatch.setattr(prompts, "_CHECK_BYTES", chunk_bytes)
    with pytest.raises(ValueError, match=rf"line 3 \(byte offset {content.index(0xe9)}\) has 0xe9"):
        PromptDataset(str(path))


def test_bytes_that_are_not_utf8_in_another_column_fail_at_load_not_in_training(tmp_path):
    # The prompt and answer read fine; the reward's column would fail only when its batch is read.
    content = (b'{"prompt": "1+1=", "answer": "2", "source": "ok"}\n'
               b'{"prompt": "2+2=", "answer": "4", "source": "caf\xe9"}\n')
    path = tmp_path / "p.jsonl"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=rf"data.train: .*p.jsonl is not UTF-8 text: line 2 \(byte offset "
                                         rf"{content.index(0xe9)}\) has 0xe9 \(invalid continuation byte\)"):
        PromptDataset(str(path))


def test_bytes_that_are_not_utf8_in_parquet_name_the_row_and_column(tmp_path):
    # Parquet does not check its text: the bytes reach Arrow as they are.
    raw = pa.array([b"1+1=", b"caf\xff", b"3+3="], pa.binary())
    text = pa.Array.from_buffers(pa.string(), len(raw), raw.buffers())
    pq.write_table(pa.table({"prompt": pa.array(["a", "b", "c"]), "answer": text}), tmp_path / "p.parquet")
    with pytest.raises(ValueError, match=r"data.test: .*p.parquet: row 1, column 'answer', holds text that is not "
                                         r"UTF-8; save the data as UTF-8, or remove that row"):
        PromptDataset(str(tmp_path / "p.parquet"), config_key="data.test")


def test_rows_with_other_columns_get_nulls_so_every_batch_has_every_column(tmp_path):
    # A batch hands the reward one list per column: with Arrow every row has every column, null where it had none.
    rows = [{"prompt": "1+1", "answer": "2", "level": 1}, {"prompt": "2+2", "answer": "4", "source": "x"}]
    dataset = PromptDataset(str(write_rows(tmp_path / "mixed.jsonl", rows)))
    assert collate_rows(dataset.__getitems__([0, 1])) == {
        "prompt": ["1+1", "2+2"], "answer": ["2", "4"], "level": [1, None], "source": [None, "x"]}
