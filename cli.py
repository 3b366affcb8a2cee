"""`python cli.py fit --config configs/tiny_arith.yaml` from the repository: the same command line as the installed
`lightning-logra` console script (`lightning_logra/cli.py`)."""

if __name__ == "__main__":
    # Imported here, not at the top: a reward process (started with "spawn") imports this file again as its main
    # module, and needs none of Lightning (about 5 s of every reward process's start).
    from lightning_logra.cli import console_main

    console_main()
