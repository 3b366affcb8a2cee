"""`trainer.strategy.init_args.dense.optimizer` (`lightning_logra.train.optimizers`): the spec is checked before
anything loads, each family's parameter groups are the ones its package documents (a step equals the constructor called
by hand), and a projector state survives a checkpoint loaded with weights_only=True."""

import importlib.util
import io

import pytest
import torch

from conftest import make_tiny_qwen2
from lightning_logra.train.checkpoint import check_resumable
from lightning_logra.train.dense import CONFIG_KEY as DENSE_KEY
from lightning_logra.train.optimizers import FAMILIES, OptimizerSpec, build_optimizer, projected_matrices

KEY = f"{DENSE_KEY}.optimizer"  # where a dense run's config names its optimizer


def _needs(module: str):
    return pytest.mark.skipif(importlib.util.find_spec(module) is None,
                              reason=f"{module} is not installed (the peers extra: pip install -e .[peers])")


@pytest.mark.parametrize("value, message", [
    (42, "trainer.strategy.init_args.dense.optimizer must be a class path or"),
    ({"init_args": {"lr": 1.0}}, "trainer.strategy.init_args.dense.optimizer must be a class path or"),
    ({"class_path": "torch.optim.AdamW", "args": {}}, "trainer.strategy.init_args.dense.optimizer must be a class path "
                                                      "or"),
    ({"class_path": "torch.optim.AdamW", "init_args": [1]}, "trainer.strategy.init_args.dense.optimizer.init_args must "
                                                            "be a mapping"),
    ("torch.nn.Linear", "trainer.strategy.init_args.dense.optimizer.class_path: torch.nn.Linear is not a "
                        "torch.optim.Optimizer subclass"),
    ("AdamW", "trainer.strategy.init_args.dense.optimizer.class_path: AdamW is not a torch.optim.Optimizer subclass"),
    ({"class_path": "torch.optim.AdamW", "init_args": {"rank": 4}},
     "trainer.strategy.init_args.dense.optimizer.init_args.rank: torch.optim.AdamW takes no such argument"),
    ({"class_path": "torch.optim.SGD", "init_args": {"lr": 0}},
     "trainer.strategy.init_args.dense.optimizer.init_args.lr must be a positive"),
    ({"class_path": "torch.optim.SGD", "init_args": {"lr": float("nan")}}, "init_args.lr must be a positive"),
    # classes that cannot take a step here, and settings torch refused only at the first step
    ("torch.optim.Optimizer", "torch.optim.Optimizer cannot be the dense or LoRA optimizer: it is the base class"),
    ("torch.optim.LBFGS", "torch.optim.LBFGS cannot be the dense or LoRA optimizer: its step needs a closure"),
    ("torch.optim.SparseAdam", "SparseAdam cannot be the dense or LoRA optimizer: it takes only sparse gradients"),
    ("lightning_logra.sketch.SketchAdam", "SketchAdam cannot be the dense or LoRA optimizer: it is a sketch optimizer"),
    ({"class_path": "torch.optim.AdamW", "init_args": {"weight_decay": -1}},
     "trainer.strategy.init_args.dense.optimizer.init_args: torch.optim.AdamW refuses them (Invalid weight_decay "
     "value: -1"),
    ({"class_path": "torch.optim.AdamW", "init_args": {"betas": [2, 0.9]}},
     "trainer.strategy.init_args.dense.optimizer.init_args: torch.optim.AdamW refuses them (Invalid beta parameter at "
     "index 0"),
])
def test_a_bad_spec_is_refused_naming_its_key(value, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("(", r"\(")):
        OptimizerSpec.parse(value, KEY)


def test_a_package_that_is_not_installed_names_the_extra():
    with pytest.raises(ImportError,
                       match=r"trainer\.strategy\.init_args\.dense\.optimizer\.class_path: no_such_package\.Opt does "
                             r"not import .*pip install -e \"\.\[peers\]\""):
        OptimizerSpec.parse("no_such_package.Opt", KEY)


def test_none_is_adamw_and_a_class_path_alone_takes_the_modes_lr():
    model = make_tiny_qwen2()
    params = list(model.parameters())
    assert OptimizerSpec.parse(None, KEY) is None
    default = build_optimizer(None, model, params, 0.01, 0.1)
    assert type(default) is torch.optim.AdamW and default.defaults["lr"] == 0.01
    spec = OptimizerSpec.parse("torch.optim.SGD", KEY)
    sgd = build_optimizer(spec, model, params, 0.01, 0.1)
    assert type(sgd) is torch.optim.SGD and (sgd.defaults["lr"], sgd.defaults["weight_decay"]) == (0.01, 0.1)
    own = build_optimizer(OptimizerSpec.parse({"class_path": "torch.optim.SGD", "init_args": {"lr": 0.5,
                                                                                              "momentum": 0.9}}, KEY),
                          model, params, 0.01, 0.0)
    assert (own.defaults["lr"], own.defaults["momentum"]) == (0.5, 0.9)


def test_the_projected_matrices_are_the_linear_weights_wider_than_the_rank_and_not_the_head():
    model = make_tiny_qwen2()  # hidden 64, MLP 128, k/v 32 wide (GQA); the head is tied to the embedding
    params = [p for p in model.parameters()]
    names = {id(p): n for n, p in model.named_parameters()}
    at_16 = {names[id(p)].split(".")[-2] for p in projected_matrices(model, params, 16)}
    assert at_16 == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert {names[id(p)].split(".")[-2] for p in projected_matrices(model, params, 32)} == {
        "q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}  # k/v are 32 × 64: nothing to gain at rank 32
    frozen = [p for n, p in model.named_parameters() if "mlp" not in n]
    assert all("self_attn" in names[id(p)] for p in projected_matrices(model, frozen, 16))


def test_a_sharded_matrix_is_not_projected():
    # Under FSDP a rank holds some rows of each matrix: GaLore's SVD of them would differ from rank to rank and from
    # the whole matrix's. Refused, whether the shard is a DTensor (FSDP2; its .shape is the whole matrix's) or a
    # plain tensor of the shard's shape.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    model = make_tiny_qwen2()
    layer = model.model.layers[0].mlp.up_proj
    whole = layer.weight
    layer.weight = torch.nn.Parameter(whole.detach()[: whole.shape[0] // 2].clone())
    with pytest.raises(ValueError,
                       match=r"trainer\.strategy\.init_args\.dense\.optimizer: model\.layers\.0\.mlp\.up_proj\.weight "
                             r"is sharded \(Parameter of local shape \(64, 64\)\).*one device or with DDP"):
        projected_matrices(model, list(model.parameters()), 16, KEY)
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        layer.weight = torch.nn.Parameter(distribute_tensor(whole.detach(), mesh, [Shard(0)]))
        assert tuple(layer.weight.shape) == (layer.out_features, layer.in_features)  # the whole matrix's
        with pytest.raises(ValueError, match=r"up_proj\.weight is sharded \(DTensor of local shape \(128, 64\)\)"):
            projected_matrices(model, list(model.parameters()), 16, KEY)
    finally:
        torch.distributed.destroy_process_group()


def test_a_rank_family_without_a_rank_is_refused():
    if importlib.util.find_spec("galore_torch") is None:
        pytest.skip("galore_torch is not installed (the peers extra: pip install -e .[peers])")
    with pytest.raises(ValueError,
                       match=r"trainer\.strategy\.init_args\.dense\.optimizer\.init_args\.rank must be a positive "
                             r"integer, got None: galore_torch\.GaLoreAdamW projects"):
        OptimizerSpec.parse({"class_path": "galore_torch.GaLoreAdamW", "init_args": {"lr": 1e-3}}, KEY)


@_needs("galore_torch")
def test_a_rank_at_or_above_every_matrixs_sides_is_said_to_be_plain_adamw(caplog):
    model = make_tiny_qwen2()  # its widest matrix's narrow side: 64
    spec = OptimizerSpec.parse({"class_path": "galore_torch.GaLoreAdamW", "init_args": {"rank": 64}}, KEY)
    with caplog.at_level("WARNING"):
        spec.build(model, list(model.parameters()), 1e-3, 0.0)
    assert "rank=64 is at or above both sides of every trained matrix" in caplog.text


def _two_steps(optimizer, model, seed):
    """Two steps of `optimizer` on gradients drawn from `seed`."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=generator)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


FAMILY_CASES = [
    pytest.param("galore_torch.GaLoreAdamW", {"rank": 8, "update_proj_gap": 1, "scale": 0.5},
                 marks=_needs("galore_torch")),
    pytest.param("galore_torch.GaLoreAdafactor", {"rank": 8, "scale_parameter": False, "relative_step": False},
                 marks=_needs("galore_torch")),
    pytest.param("fira.FiraAdamW", {"rank": 8, "alpha": 0.5}, marks=_needs("fira")),
    pytest.param("apollo_torch.APOLLOAdamW", {"rank": 8, "scale_type": "channel", "update_proj_gap": 1},
                 marks=_needs("apollo_torch")),
    pytest.param("apollo_torch.APOLLOAdamW", {"rank": 1, "scale_type": "tensor", "scale": 128},
                 marks=_needs("apollo_torch"), id="apollo-mini"),
]


@pytest.mark.parametrize("class_path, init_args", FAMILY_CASES)
def test_a_familys_step_is_its_constructor_called_with_its_documented_groups(class_path, init_args):
    spec = OptimizerSpec.parse({"class_path": class_path, "init_args": {"lr": 1e-2, **init_args}}, KEY)
    ours, theirs = make_tiny_qwen2(), make_tiny_qwen2()
    optimizer = spec.build(ours, list(ours.parameters()), 1e-3, 0.0)
    # By hand, as the package's README builds it: the projected matrices in a group with the projection's settings.
    family = spec.family
    group = {**family.group_settings, **{k: v for k, v in init_args.items() if k in family.group_settings}}
    projected = projected_matrices(theirs, list(theirs.parameters()), group["rank"])
    plain = [p for p in theirs.parameters() if all(p is not q for q in projected)]
    others = {k: v for k, v in init_args.items() if k not in family.group_settings}
    by_hand = spec.optimizer_class()([{"params": plain}, {"params": projected, **group}], lr=1e-2, **others)
    assert len(optimizer.param_groups) == 2 and optimizer.param_groups[1]["rank"] == group["rank"]
    _two_steps(optimizer, ours, seed=1)
    _two_steps(by_hand, theirs, seed=1)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(ours.parameters(), make_tiny_qwen2().parameters()))


@pytest.mark.parametrize("class_path, init_args", FAMILY_CASES)
def test_a_projector_state_survives_a_weights_only_checkpoint(class_path, init_args):
    spec = OptimizerSpec.parse({"class_path": class_path, "init_args": {"lr": 1e-2, **init_args}}, KEY)
    model, resumed_model = make_tiny_qwen2(), make_tiny_qwen2()
    optimizer = spec.build(model, list(model.parameters()), 1e-3, 0.0)
    _two_steps(optimizer, model, seed=1)
    saved = io.BytesIO()
    torch.save(optimizer.state_dict(), saved)
    saved.seek(0)
    loaded = torch.load(saved, weights_only=True)  # as train.safe_load reads a checkpoint
    resumed_model.load_state_dict(model.state_dict())
    resumed = spec.build(resumed_model, list(resumed_model.parameters()), 1e-3, 0.0)
    resumed.load_state_dict(loaded)
    assert any("projector" in state for state in resumed.state.values())
    assert all(type(state["projector"]).__module__.startswith(class_path.split(".")[0])
               for state in resumed.state.values() if "projector" in state)
    _two_steps(optimizer, model, seed=2)
    _two_steps(resumed, resumed_model, seed=2)
    for a, b in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(a, b)


@_needs("galore_torch")
def test_a_projector_of_another_class_is_refused_on_load():
    spec = OptimizerSpec.parse({"class_path": "galore_torch.GaLoreAdamW", "init_args": {"rank": 8}}, KEY)
    model = make_tiny_qwen2()
    optimizer = spec.build(model, list(model.parameters()), 1e-3, 0.0)
    _two_steps(optimizer, model, seed=1)
    state = optimizer.state_dict()
    projected = next(s for s in state["state"].values() if "projector" in s)
    projected["projector"]["__projector__"] = "os.system"
    with pytest.raises(ValueError, match="holds a projector of class 'os.system', not one of galore-torch's"):
        spec.build(model, list(model.parameters()), 1e-3, 0.0).load_state_dict(state)


def test_every_family_names_classes_of_its_own_package():
    for module, family in FAMILIES.items():
        assert family.group_settings["rank"] is None  # no default: it must be given
        assert all(path.startswith(f"{module}.") for path in family.projectors)


def test_a_checkpoint_of_another_optimizer_is_not_resumed():
    saved = {"lightning_logra": {"format": 2, "package": "x", "weights_dtype": "float32", "training": "densely",
                                 "optimizer": "galore_torch.GaLoreAdamW"}}
    current = {"format": 2, "package": "x", "weights_dtype": "float32", "training": "densely"}
    with pytest.raises(ValueError, match="the strategy's optimizer: the checkpoint's state is "
                                         "galore_torch.GaLoreAdamW's, this run's optimizer AdamW"):
        check_resumable(saved, current)
    check_resumable(saved, {**current, "optimizer": "galore_torch.GaLoreAdamW"})
