"""RunDirectory.claim_version: runs started at once on one folder each get a version_N of their own."""

from types import SimpleNamespace

from lightning.pytorch.loggers import TensorBoardLogger

from lightning_logra.callbacks import RunDirectory


def _claim(root, **logger_options) -> TensorBoardLogger:
    logger = TensorBoardLogger(root, name="run", **logger_options)
    RunDirectory().claim_version(SimpleNamespace(logger=logger))
    return logger


def test_a_version_taken_between_the_listing_and_the_claim_goes_to_the_next_number(tmp_path, monkeypatch):
    first = _claim(tmp_path)
    assert first.version == 0 and (tmp_path / "run" / "version_0").is_dir()
    # A second run listed the folder before the first created version_0: TensorBoard's logger would take 0 as well
    monkeypatch.setattr(TensorBoardLogger, "_get_next_version", lambda self: 0)
    second = _claim(tmp_path)
    assert second.version == 1 and (tmp_path / "run" / "version_1").is_dir()


def test_an_explicit_version_or_another_rank_claims_nothing(tmp_path, monkeypatch):
    assert _claim(tmp_path, version=7).version == 7
    assert not (tmp_path / "run").exists()
    for variable in ("LOCAL_RANK", "NODE_RANK", "RANK", "SLURM_PROCID"):
        monkeypatch.setenv(variable, "1")
        _claim(tmp_path)
        assert not (tmp_path / "run").exists(), variable
        monkeypatch.delenv(variable)
