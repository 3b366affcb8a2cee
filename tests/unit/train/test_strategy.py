import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from conftest import SKETCH_TARGETS, make_tiny_qwen2
from lightning_logra.sketch import SketchAdam
from lightning_logra.sketch.config import SketchConfig
from lightning_logra.train.strategies import SketchStrategy


def test_config_freezes_the_rest_or_trains_it_densely():
    model = make_tiny_qwen2()
    handles = SketchConfig(SKETCH_TARGETS, rank=4).install(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{name}.sketch_param" for name in handles}

    model = make_tiny_qwen2()
    config = SketchConfig(SKETCH_TARGETS, rank=4, train_rest=True, rest_lr=1e-3)
    handles = config.install(model)
    sketch, dense = config.build_optimizers(model, handles)
    assert isinstance(sketch, SketchAdam) and isinstance(dense, torch.optim.AdamW)
    dense_names = {n for n, p in model.named_parameters() if any(p is q for q in dense.param_groups[0]["params"])}
    assert "model.embed_tokens.weight" in dense_names and "model.norm.weight" in dense_names
    assert not any(n.endswith(("q_proj.weight", "sketch_param")) for n in dense_names)


@pytest.fixture
def two_fake_gpus(monkeypatch):
    """This CPU machine as a host with two CUDA devices, as far as torch's and Lightning's device queries go."""
    import lightning.fabric.accelerators.cuda as fabric_cuda
    import lightning.pytorch.accelerators.cuda as pytorch_cuda

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(fabric_cuda, "num_cuda_devices", lambda: 2)
    monkeypatch.setattr(pytorch_cuda, "num_cuda_devices", lambda: 2)


def _trainer(**kwargs) -> Trainer:
    return Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, **kwargs)


def test_sketch_strategy_runs_on_the_trainers_device(two_fake_gpus):
    # The embedded default (accelerator cpu) on a GPU host: the strategy used to pick cuda:0 whenever CUDA existed,
    # which the CPU accelerator refuses when the run starts.
    trainer = _trainer(accelerator="cpu", devices=1, strategy=SketchStrategy())
    assert trainer.strategy.root_device == torch.device("cpu")
    trainer.strategy.accelerator.setup_device(trainer.strategy.root_device)  # what fit does first; raises on cuda:0
    # The GPU is the one trainer.devices names.
    assert _trainer(accelerator="cuda", devices=[1], strategy=SketchStrategy()).strategy.root_device == torch.device(
        "cuda", 1)
    # A device given to the strategy itself must agree with the accelerator.
    assert _trainer(strategy=SketchStrategy(device="cuda:1")).strategy.root_device == torch.device("cuda", 1)
    with pytest.raises(MisconfigurationException, match="CPU parallel_devices"):
        _trainer(accelerator="cuda", strategy=SketchStrategy(device="cpu"))
