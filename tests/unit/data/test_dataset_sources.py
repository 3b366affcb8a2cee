"""Where prompt sets come from: datasets.load_dataset's path, subset name, data_files, revision and split.

No hub is reachable here, so the hub's layout is rebuilt locally: a folder with a README whose `configs:` list the
subsets and their files, as openai/gsm8k's does, loads through the same `datasets` code as the hub repository (it
fails the same way without a subset name). A revision only means something on the hub: that it reaches
`load_dataset` cannot be checked offline; that a local path refuses one is.
"""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from datasets import Dataset, DatasetDict

from conftest import write_rows
from lightning_logra.data.module import PromptDataModule
from lightning_logra.data.prompts import DatasetSource, PromptDataset

pytestmark = pytest.mark.usefixtures("hf_cache")

GSM8K_README = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
- config_name: socratic
  data_files:
  - split: train
    path: socratic/train-*
  - split: test
    path: socratic/test-*
---
"""


@pytest.fixture
def gsm8k_like(tmp_path) -> str:
    """A two-subset dataset laid out like openai/gsm8k (question / answer, splits train and test)."""
    root = tmp_path / "gsm8k"
    for subset in ("main", "socratic"):
        (root / subset).mkdir(parents=True)
        for split, count in (("train", 4), ("test", 2)):
            rows = [{"question": f"{subset} {split} {i}?", "answer": f"#### {i}"} for i in range(count)]
            pq.write_table(pa.Table.from_pylist(rows), root / subset / f"{split}-00000-of-00001.parquet")
    (root / "README.md").write_text(GSM8K_README)
    return str(root)


def questions(dataset):
    return [item["prompt"] for item in dataset]


def test_a_dataset_with_subsets_needs_a_name_and_the_error_says_which(gsm8k_like):
    with pytest.raises(ValueError, match=r"(?s)data.train: Config name is missing.*\['main', 'socratic'\].*"
                                         r"data.train takes path, name, data_files, revision and split"):
        PromptDataset(gsm8k_like, prompt_key="question")
    with pytest.raises(ValueError, match=r"data.train: BuilderConfig 'nope' not found"):
        PromptDataset(DatasetSource(gsm8k_like, name="nope"), prompt_key="question")


def test_subset_name_and_split(gsm8k_like):
    train = PromptDataset(DatasetSource(gsm8k_like, name="socratic"), prompt_key="question")
    assert questions(train) == [f"socratic train {i}?" for i in range(4)]
    # The split the data module asks for when the source names none, then the source's own, slices included.
    assert questions(PromptDataset(DatasetSource(gsm8k_like, name="main"), prompt_key="question", split="test")) == [
        "main test 0?", "main test 1?"]
    sliced = PromptDataset(DatasetSource(gsm8k_like, name="main", split="train[1:3]"), prompt_key="question")
    assert questions(sliced) == ["main train 1?", "main train 2?"]
    with pytest.raises(ValueError, match=r"data.val: Unknown split \"validation\""):
        PromptDataset(DatasetSource(gsm8k_like, name="main", split="validation"), prompt_key="question",
                      config_key="data.val")


def test_data_files_choose_files_inside_the_folder(gsm8k_like):
    source = DatasetSource(gsm8k_like, data_files={"train": "socratic/test-*"})
    assert questions(PromptDataset(source, prompt_key="question")) == ["socratic test 0?", "socratic test 1?"]


def test_data_files_that_match_nothing(gsm8k_like):
    with pytest.raises(FileNotFoundError, match=r"data.train: No \(supported\) data files found in .*gsm8k"):
        PromptDataset(DatasetSource(gsm8k_like, data_files="main/nope-*"), prompt_key="question")


def test_a_builder_name_with_data_files_reads_several_local_files(tmp_path):
    first = write_rows(tmp_path / "a.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    second = write_rows(tmp_path / "b.jsonl", [{"prompt": "2+2=", "answer": "4"}])
    dataset = PromptDataset(DatasetSource("json", data_files=[str(first), str(second)]))
    assert questions(dataset) == ["1+1=", "2+2="]


def test_a_folder_written_by_save_to_disk(tmp_path):
    DatasetDict({"train": Dataset.from_list([{"prompt": "1+1=", "answer": "2"}]),
                 "test": Dataset.from_list([{"prompt": "3+3=", "answer": "6"}])}).save_to_disk(tmp_path / "saved")
    assert questions(PromptDataset(str(tmp_path / "saved"), split="test")) == ["3+3="]


def test_a_local_path_refuses_a_revision_and_a_file_refuses_data_files_and_a_name(tmp_path, gsm8k_like):
    with pytest.raises(ValueError, match=r"data.train: revision 'v1.0' applies to hub datasets; the local folder"):
        PromptDataset(DatasetSource(gsm8k_like, name="main", revision="v1.0"), prompt_key="question")
    path = str(write_rows(tmp_path / "p.jsonl", [{"prompt": "1+1=", "answer": "2"}]))
    with pytest.raises(ValueError, match=r"data.train: revision 'v1.0' applies to hub datasets; the local file"):
        PromptDataset(DatasetSource(path, revision="v1.0"))
    with pytest.raises(ValueError, match=r"data.train: path '.*p.jsonl' is a file, so data_files has nothing"):
        PromptDataset(DatasetSource(path, data_files="*.jsonl"))
    with pytest.raises(ValueError, match=r"data.train: name 'main' picks a subset .*; the local file '.*p.jsonl' is"):
        PromptDataset(DatasetSource(path, name="main"))


def test_the_data_module_reads_train_and_eval_splits_of_one_subset(gsm8k_like):
    # openai/gsm8k's usual set-up: train on main/train, evaluate on main/test (the default eval_split).
    module = PromptDataModule(train=DatasetSource(gsm8k_like, name="main"), val=DatasetSource(gsm8k_like, name="main"),
                              prompt_key="question", batch_size=2)
    module.setup("fit")
    assert questions(module.train_set) == [f"main train {i}?" for i in range(4)]
    # Without an eval_preset the evaluation set has the training set's columns.
    assert questions(module.eval_sets["validate"]) == ["main test 0?", "main test 1?"]


def test_a_config_names_the_subset_as_a_mapping(run_cli, tmp_path, gsm8k_like):
    config = tmp_path / "data.yaml"
    config.write_text(f"""data:
  class_path: lightning_logra.data.module.PromptDataModule
  init_args:
    train: {{path: {gsm8k_like}, name: socratic, split: "train[:2]"}}
    val: {{path: {gsm8k_like}, name: main}}
    prompt_key: question
    batch_size: 2
""")
    cli = run_cli("tiny_arith", "--config", str(config), fast=False, run=False)
    assert cli.datamodule.sources["fit"] == DatasetSource(gsm8k_like, name="socratic", split="train[:2]")
    cli.datamodule.setup("fit")
    assert questions(cli.datamodule.train_set) == ["socratic train 0?", "socratic train 1?"]
