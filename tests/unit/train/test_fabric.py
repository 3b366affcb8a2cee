"""SketchFabricStrategy: a Fabric loop trains exactly as the same steps done by hand in plain PyTorch, on the
device Fabric selects, refuses what it cannot honour, and resumes from fabric.save / fabric.load."""

from functools import partial

import pytest
import torch
from lightning.fabric import Fabric

from conftest import SKETCH_TARGETS, make_tiny_qwen2
from lightning_logra.sketch import SketchAdam, SketchedLinear, SketchSGD
from lightning_logra.sketch.config import SketchConfig
from lightning_logra.train.checkpoint import AtomicCheckpointIO
from lightning_logra.train.strategies.fabric import SketchFabricStrategy

# SGD with momentum and the sketches alone; Adam with an AdamW over everything else (embeddings, norms).
CONFIGS = {
    "sgd": dict(target_modules=SKETCH_TARGETS, rank=4, optimizer=partial(SketchSGD, lr=0.05, momentum=0.9)),
    "adam_train_rest": dict(target_modules=SKETCH_TARGETS, rank=4, optimizer=partial(SketchAdam, lr=1e-2),
                            train_rest=True, rest_lr=1e-3),
    # one A per input (q/k/v, gate/up): Fabric's set-up installs the shared groups as the plain path does
    "sgd_shared_projection": dict(target_modules=SKETCH_TARGETS, rank=4, optimizer=partial(SketchSGD, lr=0.05),
                                  share_projection=True),
}


def _batches(n: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 97, (2, 8), generator=generator) for _ in range(n)]


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if not n.endswith("sketch_param")}


def _fabric(config: dict) -> Fabric:
    return Fabric(accelerator="cpu", devices=1, strategy=SketchFabricStrategy(SketchConfig(**config)))


def _setup(fabric: Fabric, net: torch.nn.Module):
    model = fabric.setup(net)
    optimizers = fabric.setup_optimizers(*fabric.strategy.optimizers)
    return model, optimizers if isinstance(optimizers, tuple) else (optimizers,)


def _step(fabric, model, optimizers, ids) -> None:
    fabric.backward(model(input_ids=ids, labels=ids).loss)
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad()


def _by_hand(config: dict, batches) -> torch.nn.Module:
    """The same steps without Fabric: install, build the optimizers, step."""
    net = make_tiny_qwen2()
    sketch = SketchConfig(**config)
    optimizers = sketch.build_optimizers(net, sketch.install(net))
    for ids in batches:
        net(input_ids=ids, labels=ids).loss.backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    return net


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_fabric_loop_takes_the_same_steps_as_plain_pytorch(name):
    config, batches = CONFIGS[name], _batches(3)
    fabric = _fabric(config)
    net = make_tiny_qwen2()
    model, optimizers = _setup(fabric, net)
    assert isinstance(net.model.layers[0].self_attn.q_proj, SketchedLinear)
    assert [type(o.optimizer) for o in optimizers] == [type(o) for o in fabric.strategy.optimizers]
    for ids in batches:
        _step(fabric, model, optimizers, ids)

    expected, initial = _weights(_by_hand(config, batches)), _weights(make_tiny_qwen2())
    trained = _weights(net)
    assert trained.keys() == expected.keys()
    for n in trained:
        torch.testing.assert_close(trained[n], expected[n], rtol=1e-6, atol=1e-7, msg=n)
    assert not torch.equal(trained["model.layers.0.self_attn.q_proj.weight"],
                           initial["model.layers.0.self_attn.q_proj.weight"])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_only_sketched_weights_and_the_dense_rest_change(name):
    config = CONFIGS[name]
    fabric = _fabric(config)
    net = make_tiny_qwen2()
    before = _weights(net)
    model, optimizers = _setup(fabric, net)
    for ids in _batches(2):
        _step(fabric, model, optimizers, ids)

    after = _weights(net)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    sketched = {f"{layer}.weight" for layer in fabric.strategy.handles}
    assert len(sketched) == 2 * len(SKETCH_TARGETS)
    if config.get("train_rest"):
        # Everything but the sketched layers' biases (train_bias is off): embeddings, norms, and the sketched weights.
        assert changed == {n for n in before if not (n.endswith(".bias") and n.removesuffix(".bias") in
                                                     fabric.strategy.handles)}
    else:
        assert changed == sketched
    assert all(handle.weight.grad is None for handle in fabric.strategy.handles.values())


def test_bad_use_is_refused_with_a_clear_message():
    fabric = _fabric(CONFIGS["sgd"])
    net = make_tiny_qwen2()
    user_optimizer = torch.optim.AdamW(net.parameters())
    with pytest.raises(ValueError, match=r"cannot take the optimizers passed to fabric.setup \(AdamW\).*"
                                         r"fabric.setup_optimizers\(\*fabric.strategy.optimizers\)"):
        fabric.setup(net, user_optimizer)
    with pytest.raises(RuntimeError, match="set up the model before the optimizers"):
        fabric.setup_optimizers(user_optimizer)

    fabric = _fabric(CONFIGS["sgd"])
    fabric.setup(net)
    with pytest.raises(ValueError, match="only sets up the optimizers it built .* not this AdamW"):
        fabric.setup_optimizers(user_optimizer)
    with pytest.raises(RuntimeError, match="trains one model and has set one up already"):
        fabric.setup(make_tiny_qwen2())

    sketched = make_tiny_qwen2()
    SketchConfig(SKETCH_TARGETS, rank=4).install(sketched)
    with pytest.raises(ValueError, match="already has sketches installed"):
        _fabric(CONFIGS["sgd"]).setup(sketched)

    with pytest.raises(ValueError, match="trains on one device, but Fabric selected 2"):
        Fabric(accelerator="cpu", devices=2, strategy=SketchFabricStrategy())


def test_the_device_is_the_one_fabric_selects(monkeypatch):
    # This CPU machine as a host with two CUDA devices, as far as Fabric's device queries go (nothing runs there).
    import lightning.fabric.accelerators.cuda as fabric_cuda

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(fabric_cuda, "num_cuda_devices", lambda: 2)
    # Not cuda:0 because CUDA exists: the CPU when the accelerator says so, the GPU that `devices` names otherwise.
    assert Fabric(accelerator="cpu", devices=1, strategy=SketchFabricStrategy()).device == torch.device("cpu")
    assert Fabric(accelerator="cuda", devices=[1], strategy=SketchFabricStrategy()).device == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="trains on one device"):
        Fabric(accelerator="cuda", devices=2, strategy=SketchFabricStrategy())


def test_save_and_load_resume_to_the_same_weights(tmp_path):
    config, batches = CONFIGS["adam_train_rest"], _batches(3)
    path = tmp_path / "state.ckpt"

    fabric = _fabric(config)
    assert isinstance(fabric.strategy.checkpoint_io, AtomicCheckpointIO)
    uninterrupted = make_tiny_qwen2()
    model, (sketch, dense) = _setup(fabric, uninterrupted)
    for ids in batches[:2]:
        _step(fabric, model, (sketch, dense), ids)
    fabric.save(path, {"model": model, "sketch": sketch, "dense": dense, "step": 2})
    _step(fabric, model, (sketch, dense), batches[2])

    fabric = _fabric(config)
    resumed = make_tiny_qwen2(seed=1)  # other weights: they must all come from the checkpoint
    model, (sketch, dense) = _setup(fabric, resumed)
    left = fabric.load(path, {"model": model, "sketch": sketch, "dense": dense})
    assert left == {"step": 2} and sketch.updates == 2 and isinstance(sketch.optimizer, SketchAdam)
    _step(fabric, model, (sketch, dense), batches[2])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.ckpt"]  # no temporary left beside it

    expected, got = _weights(uninterrupted), _weights(resumed)
    for n in expected:
        torch.testing.assert_close(got[n], expected[n], rtol=1e-6, atol=1e-7, msg=n)

    # A checkpoint taken under other sketch settings is refused, not loaded into the wrong projections.
    fabric = _fabric({**config, "seed": 7})
    model, (sketch, dense) = _setup(fabric, make_tiny_qwen2())
    with pytest.raises(ValueError, match="cannot resume.*sketch.seed: checkpoint 0, this run 7"):
        fabric.load(path, {"model": model, "sketch": sketch, "dense": dense})
