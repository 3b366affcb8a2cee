"""train/safe_load.load_file on checkpoint files built by hand: a zip with members of its own is read for what
torch.load needs and nothing else, and a tensor subclass (whose class could be anything) is refused by name."""

import zipfile

import pytest
import torch

from lightning_logra.train.safe_load import UnreadableCheckpoint, UnsafeCheckpoint, load_file


class Marked(torch.Tensor):
    """A tensor subclass: unpickling one constructs the class named in the file."""


def _saved(tmp_path, value) -> str:
    path = tmp_path / "model.ckpt"
    torch.save(value, path)
    return str(path)


def test_a_checkpoint_zip_with_members_of_its_own_loads_only_what_torch_wrote(tmp_path):
    value = {"state_dict": {"w": torch.arange(6.0).view(2, 3)}, "global_step": 3}
    path = _saved(tmp_path, value)
    with zipfile.ZipFile(path, "a") as archive:
        archive.writestr("model/extra.py", "raise SystemExit('ran')")
        archive.writestr("model/data/99", b"storage bytes nothing names")
    loaded = load_file(path)
    assert loaded.keys() == value.keys() and torch.equal(loaded["state_dict"]["w"], value["state_dict"]["w"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.ckpt"]  # nothing extracted


@pytest.mark.parametrize("member", ["../outside.txt", "/tmp/absolute.txt"])
def test_a_member_outside_the_archives_folder_or_a_truncated_file_is_refused_naming_the_file(tmp_path, member):
    path = _saved(tmp_path, {"w": torch.ones(3)})
    with zipfile.ZipFile(path, "a") as archive:
        archive.writestr(member, "written elsewhere")
    with pytest.raises(UnreadableCheckpoint, match=rf"{path}: not a checkpoint file torch can read \(file in "
                                                   "archive is not in a subdirectory"):
        load_file(path)
    truncated = _saved(tmp_path, {"w": torch.ones(3)})
    data = open(truncated, "rb").read()
    open(truncated, "wb").write(data[: len(data) // 2])
    with pytest.raises(UnreadableCheckpoint, match="failed finding central directory"):
        load_file(truncated)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.ckpt"]  # nothing extracted


def test_a_tensor_subclass_is_refused_naming_its_class_and_a_parameter_loads(tmp_path):
    marked = torch.zeros(2).as_subclass(Marked)
    with pytest.raises(UnsafeCheckpoint, match=r"refused to load: it pickles .*Marked"):
        load_file(_saved(tmp_path, {"w": marked}))
    parameter = torch.nn.Parameter(torch.ones(2))
    assert torch.equal(load_file(_saved(tmp_path, {"w": parameter}))["w"], parameter)
