"""The recorded steps' data files (tests/recorded/, read by tests/golden.py): each reads back as the numbers its test
compares with and names a test that exists, every kind of CPU kernels of a bf16 path loads whatever this machine's
kind, a machine of another kind is told which are recorded, and `--record` writes a path's file. (The runs that
compare with them are integration tests.)"""

import ast
import json
import re

import pytest

import golden
from conftest import ROOT

FILES = sorted(golden.RECORDINGS.glob("*.json"))


@pytest.mark.parametrize("file", FILES, ids=lambda file: file.stem)
def test_each_file_holds_a_paths_numbers_and_names_the_test_that_records_it(file, monkeypatch):
    name, _, kernels = file.stem.partition(".")
    if kernels:  # read as a machine of that kind reads it
        monkeypatch.setattr(golden, "cpu_kernels", lambda: kernels)
    numbers = golden.recorded(name, per_kernels=bool(kernels))
    assert numbers.file == file and numbers.name == name and numbers.recorded and numbers.about
    assert set(numbers) - {"sum_tolerance"} == {"steps", "lr", "delta_weighted_sum", "delta_norm"}
    assert numbers["steps"] and all({"train/loss", "train/grad_norm", "train/reward_mean"} <= set(step) <=
                                    set(golden.RECORDED) for step in numbers["steps"])
    values = [numbers[key] for key in numbers if key != "steps"] + [value for step in numbers["steps"]
                                                                     for value in step.values()]
    assert all(type(value) is float for value in values)
    assert file.read_text() == golden.dumps(json.loads(file.read_text()))  # as the recorder writes it
    path, _, test = numbers.test.partition("::")
    functions = {node.name for node in ast.walk(ast.parse((ROOT / path).read_text())) if isinstance(node,
                                                                                                     ast.FunctionDef)}
    assert test.split("[")[0] in functions, numbers.test


def test_every_path_a_test_compares_with_is_recorded():
    sources = "".join(path.read_text() for path in (ROOT / "tests" / "integration").rglob("test_*.py"))
    named = set(re.findall(r'recorded\("(\w+)"', sources))
    assert named and named <= {file.name.split(".")[0] for file in FILES}


def test_a_machine_with_kernels_of_another_kind_is_told_which_are_recorded(monkeypatch):
    monkeypatch.setattr(golden, "cpu_kernels", lambda: "AVX512+bf16")
    message = (r"no numbers recorded for AVX512\+bf16 kernels \(only for AVX2\): record them with `python "
               r"tests/record.py tiny_arith_bf16`")
    with pytest.raises(pytest.fail.Exception, match=message):
        golden.recorded("tiny_arith_bf16", per_kernels=True)


def test_record_writes_the_observed_numbers_with_the_paths_settings(monkeypatch, tmp_path):
    # A kind of kernels with nothing recorded yet: its file takes the settings of another kind's.
    monkeypatch.setattr(golden, "cpu_kernels", lambda: "AVX512")
    monkeypatch.setattr(golden, "recording", {"tiny_arith_bf16"})
    monkeypatch.setattr(golden, "record_into", tmp_path)
    expected = golden.recorded("tiny_arith_bf16", per_kernels=True)
    assert expected == {"lr": 5e-06, "sum_tolerance": 0.001}
    steps = [{"kl/alpha": 4.0, "train/loss": -0.1, "train/grad_norm": 2.5, "train/reward_mean": 0.5, "kl/q": 1e-6}]
    golden.assert_matches("tiny_arith_bf16", {"steps": steps, "delta_weighted_sum": -0.03, "delta_norm": 0.07},
                          expected)
    written = json.loads((tmp_path / "tiny_arith_bf16.AVX512.json").read_text())
    assert written["steps"] == steps and list(written["steps"][0]) == list(golden.RECORDED)  # in RECORDED's order
    assert (written["lr"], written["sum_tolerance"], written["about"]) == (5e-06, 0.001, expected.about)
    assert written["test"].startswith("tests/unit/test_recorded.py::") and "AVX512 kernels" in written["recorded"]
    # a run compared with another path's numbers never writes them
    monkeypatch.setattr(golden, "recording", {"vllm_engine"})
    with pytest.raises(AssertionError):
        golden.assert_matches("remote_engine", {"steps": [], "delta_weighted_sum": 0.0, "delta_norm": 0.0},
                              golden.recorded("vllm_engine"))
    assert sorted(path.name for path in tmp_path.iterdir()) == ["tiny_arith_bf16.AVX512.json"]
