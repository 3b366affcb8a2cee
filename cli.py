"""The command line: `python cli.py fit --config configs/tiny_arith.yaml`, plus validate / test / --print_config."""

from lightning.pytorch.cli import LightningCLI

from lightning_logra.data.module import RLVRDataModule
from lightning_logra.module import RLVRModule


def main(args=None, run: bool = True) -> LightningCLI:
    return LightningCLI(
        RLVRModule,
        RLVRDataModule,
        subclass_mode_data=True,
        parser_kwargs={"parser_mode": "omegaconf"},
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )


if __name__ == "__main__":
    main()
