"""max_grad_norm clips what the optimizers receive: the sketches (sketch path) and the dense gradients (baseline)."""

from pathlib import Path

import pytest

from cli import main
from conftest import GradNormAtMost

ROOT = Path(__file__).parents[1]


@pytest.mark.parametrize("config", ["tiny_arith", "tiny_arith_dense_all"])
def test_the_optimizer_receives_at_most_max_grad_norm(config, tmp_path):
    check = GradNormAtMost()
    cli = main(["--config", str(ROOT / "configs" / f"{config}.yaml"), "--trainer.max_steps", "3",
                "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
                "--trainer.enable_model_summary", "false", "--trainer.default_root_dir", str(tmp_path),
                "--data.init_args.batch_size", "8", "--trainer.val_check_interval", "1000",
                "--model.max_grad_norm", "1e-3"], run=False)
    cli.trainer.callbacks.append(check)
    cli.trainer.fit(cli.model, cli.datamodule)
    assert check.seen == 3
    # the logged norm is the one before clipping: far above the limit, so the clipping did act
    assert float(cli.trainer.callback_metrics["train/grad_norm"]) > 0.1
