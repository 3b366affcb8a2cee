"""What a run shows while it works: a bar that counts optimizer steps, and log lines around the long waits."""



from lightning_logra.callbacks import StepProgressBar


def _fit(run_cli, root, steps: int, *extra: str):
    """A tiny run with the progress bar back on, and no validation."""
    return run_cli("tiny_arith", "--trainer.enable_progress_bar", "true", "--trainer.val_check_interval", "100",
                   *extra, steps=steps, root=root)


def test_the_bar_counts_steps_against_max_steps_resumed_runs_included(run_cli, tmp_path, capsys):
    first = _fit(run_cli, tmp_path, 2)
    bar = first.trainer.progress_bar_callback
    assert isinstance(bar, StepProgressBar)
    assert (bar.train_progress_bar.n, bar.train_progress_bar.total) == (2, 2)
    shown = capsys.readouterr().out  # Lightning's TQDM bars write to stdout
    assert "step 2/2 100%" in shown and "Epoch 0/-2" not in shown  # Lightning's bars: "Epoch 0/-2", 2 of 2 left

    checkpoint = next(tmp_path.glob("**/last.ckpt"))
    resumed = _fit(run_cli, tmp_path, 4, "--ckpt_path", str(checkpoint))
    bar = resumed.trainer.progress_bar_callback.train_progress_bar
    assert (bar.initial, bar.n, bar.total) == (2, 4, 4)  # it starts at the resumed step, and rates count this run's
    assert "step 4/4 100%" in capsys.readouterr().out


def test_a_run_resumed_inside_an_epoch_counts_steps_and_one_with_nothing_left_says_so(run_cli, tmp_path, caplog):
    checkpoints = ["--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
                   "--trainer.callbacks.every_n_train_steps=2", "--trainer.callbacks.save_top_k=-1",
                   f"--trainer.callbacks.dirpath={tmp_path / 'steps'}"]
    _fit(run_cli, tmp_path / "a", 3, *checkpoints)
    inside = next((tmp_path / "steps").glob("*step=2.ckpt"))  # an epoch was under way: the resume starts none
    bar = _fit(run_cli, tmp_path / "b", 3, "--ckpt_path", str(inside)).trainer.progress_bar_callback
    assert (bar.train_progress_bar.initial, bar.train_progress_bar.n, bar.train_progress_bar.total) == (2, 3, 3)
    # trainer.max_steps at or below the steps the checkpoint has done: Lightning ends the fit without a word
    with caplog.at_level("WARNING", logger="lightning_logra.train.module"):
        _fit(run_cli, tmp_path / "c", 2, "--ckpt_path", str(inside))
    assert "nothing to train: the checkpoint resumed from has done 2 steps, and trainer.max_steps=2" in caplog.text
