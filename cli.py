"""`python cli.py fit --config configs/tiny_arith.yaml` from the repository: the same command line as the installed
`lightning-logra` console script (`lightning_logra/cli.py`)."""

from lightning_logra.cli import main

if __name__ == "__main__":
    main()
