"""CUDA graphs by default on GPUs: the engine's enforce_eager default is eager on vLLM's CPU backend (no CUDA graphs
there) and CUDA graphs on a GPU, and the GPU configs leave it at that default beside sleep mode."""


import pytest
import yaml

from conftest import CONFIGS
from lightning_logra.rollout import VLLMEngine
from lightning_logra.rollout.vllm.launch import eager_by_default


def test_enforce_eager_defaults_to_graphs_on_a_gpu_and_eager_on_the_cpu_backend():
    assert VLLMEngine().options["enforce_eager"] is None
    assert eager_by_default(None, cpu_backend=False) is False  # CUDA graphs
    assert eager_by_default(None, cpu_backend=True) is True
    assert eager_by_default(True, cpu_backend=False) is True  # an explicit setting wins
    assert eager_by_default(False, cpu_backend=True) is False


@pytest.mark.parametrize("name", ["qwen1_5b", "qwen7b"])
def test_the_gpu_configs_generate_with_cuda_graphs_and_sleep_between_rollouts(name):
    config = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())["model"]["rollouts"]["engine"]
    assert config["class_path"] == "lightning_logra.rollout.VLLMEngine"
    engine = VLLMEngine(**config["init_args"])
    assert eager_by_default(engine.options["enforce_eager"], cpu_backend=False) is False
    assert engine.sleep_between_rollouts and engine.options["enable_sleep_mode"]
    assert engine.full_load == "auto"  # colocated on the trainer's GPU: CUDA IPC handles
