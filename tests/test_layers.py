"""The layers only point down: the math (sketch, KL, loss), the update type and the step-size contract, and the
batch/hash helpers never import the engines (nor Lightning)."""

import subprocess
import sys

import pytest

MATH = ["lightning_logra.sketch", "lightning_logra.kl", "lightning_logra.loss", "lightning_logra.batch",
        "lightning_logra.hashing", "lightning_logra.update", "lightning_logra.control"]


@pytest.mark.parametrize("module", MATH)
def test_math_does_not_import_the_rollout_engines(module):
    # A fresh interpreter, so that nothing imported by other tests hides an import.
    code = (f"import sys, {module}; "
            "bad = sorted(m for m in sys.modules if m.startswith(('lightning_logra.rollout', 'vllm', 'lightning.')))"
            "; print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"{module} imports {out}"


def test_batch_and_hashing_import_nothing_from_the_project():
    code = ("import sys, lightning_logra.batch, lightning_logra.hashing; "
            "print(','.join(sorted(m for m in sys.modules if m.startswith('lightning_logra.') "
            "and m not in ('lightning_logra.batch', 'lightning_logra.hashing'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""
