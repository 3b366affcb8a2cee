"""Records a path's numbers anew: runs the test that records it (the `test` its file in tests/recorded/ names) with
`--record <path>`, which writes the numbers the run observes over that file (or into `--into DIR`).

    python tests/record.py                        # the recorded paths and their tests
    python tests/record.py tiny_arith [PATH ...]  # record these paths anew
    python tests/record.py tiny_arith --into /tmp/recorded [-- PYTEST ARGS]

Only when a change of numerics is the intended result, said in the commit; never to make a failing test pass
(docs/testing.md). A path recorded per kind of CPU kernels (tiny_arith_bf16) is recorded for this machine's kind
(`golden.cpu_kernels`); a path whose test is skipped here (no vLLM, no second core) is not recorded, and says so."""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))
from golden import RECORDINGS, cpu_kernels  # noqa: E402


def paths() -> dict[str, list[Path]]:
    """Each recorded path's data files (one, or one per kind of CPU kernels)."""
    found: dict[str, list[Path]] = {}
    for file in sorted(RECORDINGS.glob("*.json")):
        found.setdefault(file.name.split(".")[0], []).append(file)
    return found


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", help="the paths to record (tests/recorded/<path>[.<kernels>].json)")
    parser.add_argument("--into", type=Path, help="write the files into this folder instead of tests/recorded/")
    argv, pytest_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = parser.parse_args(argv)
    args.into = args.into.resolve() if args.into else None
    known = paths()
    if not args.paths:
        for name, files in known.items():
            print(f"{name}: {', '.join(f.name for f in files)} ({json.loads(files[0].read_text())['test']})")
        return 0
    unknown = [name for name in args.paths if name not in known]
    if unknown:
        parser.error(f"no recorded path {', '.join(unknown)} (recorded: {', '.join(known)})")
    tests = list(dict.fromkeys(json.loads(known[name][0].read_text())["test"] for name in args.paths))
    command = [sys.executable, "-m", "pytest", "-q", *tests, "-m", "long or not long", "--record",
               ",".join(args.paths), *(["--record-into", str(args.into)] if args.into else []), *pytest_args]
    print(" ".join(command), flush=True)
    started = time.time()
    status = subprocess.call(command, cwd=TESTS.parent)
    missed = []
    for name in args.paths:
        per_kernels = known[name][0].name != f"{name}.json"
        file = RECORDINGS / (f"{name}.{cpu_kernels()}.json" if per_kernels else f"{name}.json")
        written = (args.into / file.name) if args.into else file
        if not written.exists() or written.stat().st_mtime < started:
            missed.append(name)
    if missed:
        print(f"not recorded: {', '.join(missed)} (its test failed or was skipped here)", file=sys.stderr)
    return status or (1 if missed else 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
