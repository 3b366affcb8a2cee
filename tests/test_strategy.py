import torch
from lightning.fabric import Fabric

from conftest import SKETCH_TARGETS, make_tiny_qwen2
from lightning_logra.sketch import SketchAdam, SketchedLinear
from lightning_logra.sketch.config import SketchConfig
from lightning_logra.strategy import setup_fabric


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


def test_fabric_adapter_trains_with_the_same_installer():
    fabric = Fabric(accelerator="cpu", devices=1)
    model = make_tiny_qwen2()
    before = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    model, (optimizer,) = setup_fabric(fabric, model, SketchConfig(SKETCH_TARGETS, rank=4, optimizer="sgd", lr=0.1))
    assert isinstance(model.module.model.layers[0].self_attn.q_proj, SketchedLinear)
    ids = torch.randint(0, 97, (2, 8))
    fabric.backward(model(input_ids=ids, labels=ids).loss)
    optimizer.step()
    after = model.module.model.layers[0].self_attn.q_proj.weight
    assert not torch.equal(after, before) and after.grad is None
