"""The benchmarks: each module of this folder a tool run from the repository root as `python -m bench.<name>`
(`python -m bench.memory --help`), the code they share in `bench.lib` (bench/README.md)."""
