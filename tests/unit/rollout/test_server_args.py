"""`lightning-logra serve`'s command line as vLLM gets it: on the CPU backend eager unless the user says otherwise
after `--` (as VLLMEngine is), on a GPU vLLM's own default (CUDA graphs)."""

import pytest

from lightning_logra.rollout.server import parser, vllm_arguments


def _args(*extra: str, cpu: bool) -> list[str]:
    return vllm_arguments(parser().parse_args(["--model", "m", *extra]), cpu_backend=cpu)


@pytest.mark.parametrize("extra, cpu, eager", [
    ((), True, True),
    ((), False, False),
    (("--", "--no-enforce-eager"), True, False),
    (("--", "--enforce-eager"), False, True),
])
def test_the_cpu_backend_serves_eager_unless_told_otherwise(extra, cpu, eager):
    args = _args(*extra, cpu=cpu)
    assert args[:2] == ["--model", "m"] and "--worker-extension-cls" in args
    flags = [arg for arg in args if arg.split("=")[0] in ("--enforce-eager", "--no-enforce-eager")]
    assert len(flags) <= 1  # never both: the user's flag, or ours
    assert (flags == ["--enforce-eager"]) == eager
