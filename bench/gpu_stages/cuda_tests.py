"""cuda_tests: the tests that skip without CUDA (files that check `cuda.is_available`), through pytest."""

from __future__ import annotations

import shlex
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

from bench.gpu_stages.plan import Plan, Progress
from bench.lib.runs import ROOT


def junit_outcomes(path: Path) -> list[dict]:
    """Each test case of a pytest --junitxml report: its id, outcome and, unless it passed, the message."""
    cases = []
    for case in ElementTree.parse(path).iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome, message = {"failure": "failed"}.get(child.tag, child.tag), child.get("message", "")
        cases.append(dict(test=f"{case.get('classname')}::{case.get('name')}", outcome=outcome, message=message[:500]))
    return cases


def cuda_tests(plan: Plan, progress: Progress) -> dict:
    """The tests that need CUDA: those in files that ask `torch.cuda.is_available()`, selected by name (cuda or gpu).
    They import the CLI (lightning_logra.cli), which needs jsonargparse; without it they fail to collect (counted as
    errors)."""
    files = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "tests").rglob("test_*.py")
                   if "cuda.is_available" in path.read_text())
    if not files:  # pytest given no file would run the whole suite
        raise RuntimeError("no test file under tests/ asks torch.cuda.is_available()")
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        command = [sys.executable, "-m", "pytest", *files, "-k", "cuda or gpu", "-q", "-p", "no:cacheprovider",
                   f"--junitxml={report}"]
        run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=plan.tests_timeout_s)
        cases = junit_outcomes(report) if report.exists() else []
    counts = {outcome: sum(case["outcome"] == outcome for case in cases)
              for outcome in ("passed", "failed", "error", "skipped")}
    return dict(command=shlex.join(command[1:-1]), exit_code=run.returncode, **counts, tests=cases,
                output_tail=run.stdout[-3000:] + run.stderr[-2000:])
