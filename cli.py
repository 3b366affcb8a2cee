"""The command line: `python cli.py fit --config configs/tiny_arith.yaml`, plus validate / test / --print_config."""

from lightning.pytorch.cli import LightningCLI

from lightning_logra.checks import check_before_loading
from lightning_logra.data.module import RLVRDataModule
from lightning_logra.module import RLVRModule


class RLVRCLI(LightningCLI):
    def after_instantiate_classes(self) -> None:
        # The config's classes are built, nothing is loaded yet: settings that would fail or be ignored once data,
        # weights and an engine are loaded fail now (`validate` / `test` install no sketches).
        if self.subcommand in (None, "fit"):
            check_before_loading(self.model, self.trainer)


def main(args=None, run: bool = True) -> LightningCLI:
    return RLVRCLI(
        RLVRModule,
        RLVRDataModule,
        subclass_mode_data=True,
        parser_kwargs={"parser_mode": "omegaconf"},
        save_config_kwargs={"overwrite": True},
        # The optimizers come from the module (model.lr, model.lr_schedule) or the sketch strategy (sketch.*):
        # LightningCLI's own --optimizer / --lr_scheduler would be accepted and dropped, so they do not exist.
        auto_configure_optimizers=False,
        args=args,
        run=run,
    )


if __name__ == "__main__":
    main()
