"""The LoRA training mode (`lightning_logra.train.lora`): one step equals a hand-written peft + AdamW step on the same
rollouts, a resume continues exactly, exports equal the merged weights (and peft loads the adapter export), an engine
with its own weights follows through rank-2r deltas, and bad settings fail naming their key."""

import copy
import glob

import peft
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from conftest import CONFIGS, SKETCH_TARGETS
from lightning_logra.algo.advantages import group_advantages
from lightning_logra.algo.logprobs import completion_logprobs
from lightning_logra.algo.losses import token_weights
from lightning_logra.algo.update import Update
from lightning_logra.callbacks import PredictedKLBudget, RolloutWeightSync
from lightning_logra.export import export_checkpoint
from lightning_logra.paths import model_path
from lightning_logra.rollout import HFEngine, SamplingParams
from lightning_logra.train import lora
from lightning_logra.train.checkpoint import check_resumable
from lightning_logra.train.dense import DenseConfig
from lightning_logra.train.modes import DenseMode, training_mode
from lightning_logra.train.policy import pad_token_id
from lightning_logra.train.strategies import Collectives

G = 4


def _lora_run(run_cli, steps, *overrides):
    """tiny_arith_lora.yaml on the tiny model at rank 4, with `_module`'s settings and no validation: parsed and
    instantiated, for the test to fit."""
    return run_cli("tiny_arith_lora", "--model.sampling.num_generations", str(G), "--model.sampling.max_new_tokens",
                   "4", "--model.training.micro_batch_size", "4", "--model.training.max_grad_norm", "null",
                   "--model.rollouts.is_cap", "null", "--model.scoring.timeout_s", "null",
                   "--trainer.limit_val_batches", "0",
                   "--trainer.strategy.init_args.lora.rank", "4", *overrides, steps=steps, run=False)


def test_one_step_is_a_hand_written_peft_adamw_step(run_cli):
    cli = _lora_run(run_cli, 1, "--trainer.strategy.init_args.lora.alpha", "8.0",
                    "--trainer.strategy.init_args.lora.lr", "1e-2", "--trainer.strategy.init_args.lora.seed", "3")
    module = cli.model
    module.configure_model()
    base = copy.deepcopy(module.policy)
    scored = []
    score = module.score
    module.score = lambda batch, rollout, n: scored.append((rollout, *score(batch, rollout, n))) or scored[-1][1:]
    cli.trainer.fit(module, cli.datamodule)
    (rollout, rewards, _), = scored
    assert 0 < rewards.mean() < 1  # something to learn

    # By hand: peft's LoRA on the starting weights (A drawn after seeding with 3, B = 0), the policy-gradient loss of
    # the same rollouts, one backward pass, one torch AdamW step on the adapters.
    reference = copy.deepcopy(base)
    torch.manual_seed(3)
    peft.inject_adapter_in_model(peft.LoraConfig(r=4, lora_alpha=8.0, target_modules=SKETCH_TARGETS), reference)
    adapters = [p for n, p in reference.named_parameters() if ".lora_" in n]
    assert len(adapters) == 2 * 7 * 2  # A and B of 7 matrices in 2 layers
    for name, p in reference.named_parameters():
        p.requires_grad_(".lora_" in name)
    mask = rollout.completion_mask
    advantages = group_advantages(rewards, G, True)  # (N,)
    weights = token_weights(mask, "dapo", 4, mask.sum().float(), len(rewards))  # (N, C)
    logprobs, _ = completion_logprobs(reference, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids, mask,
                                      1.0, None)  # (N, C)
    (-(weights * advantages[:, None] * logprobs).sum()).backward()
    grads = {name: p.grad.clone() for name, p in reference.named_parameters() if ".lora_" in name}
    lr, eps = 1e-2, 1e-8
    torch.optim.AdamW(adapters, lr=lr, eps=eps, weight_decay=0.0).step()

    # The tolerance, from the arithmetic: AdamW's first step is lr·g/(|g| + ε) per entry, so an error δ in a
    # gradient entry (other summation orders: the trainer's chunked log-probs, another transformers) moves it by
    # lr·ε·δ/(|g| + ε)², at most lr where g cancels to about 0. δ: fp32 rounding, taken as 1e-5 of the largest entry.
    noise = 1e-5 * max(float(g.abs().max()) for g in grads.values())
    trained = dict(module.policy.named_parameters())
    for name, expected in reference.named_parameters():
        if ".lora_" in name:
            bound = 1e-6 + lr * (eps * noise / (grads[name].abs() + eps) ** 2).clamp(max=1.0)
            worst = float(((trained[name] - expected).abs() - bound).max())
            assert worst <= 0, f"{name}: off by {worst:.2e} more than AdamW's conditioning allows"
        else:
            assert torch.equal(trained[name], expected), f"{name}: a frozen weight moved"
    assert any(".lora_B." in n and trained[n].abs().sum() > 0 for n in trained)  # B left 0: the step moved it


def _fit(run_cli, root, steps, *extra):
    """A tiny run of tiny_arith_lora.yaml at rank 4, validating at its end."""
    return run_cli("tiny_arith_lora", "--trainer.val_check_interval", str(steps),
                   "--trainer.strategy.init_args.lora.rank", "4", *extra, steps=steps, root=root)


def _last(root):
    (path,) = glob.glob(str(root / "**" / "checkpoints" / "last.ckpt"), recursive=True)
    return path


@pytest.fixture(scope="module")
def resumed_runs(run_cli, tmp_path_factory):
    """4 steps straight, and 2 + 2 resumed from the checkpoint of step 2 (through the command line)."""
    root = tmp_path_factory.mktemp("lora_resume")
    straight = _fit(run_cli, root / "a", 4)
    _fit(run_cli, root / "b", 2)
    resumed = _fit(run_cli, root / "c", 4, "--ckpt_path", _last(root / "b"))
    return straight, resumed, root


def test_resume_continues_exactly(resumed_runs):
    straight, resumed, _ = resumed_runs
    assert resumed.trainer.global_step == straight.trainer.global_step == 4
    a, b = straight.model.policy.state_dict(), resumed.model.policy.state_dict()
    assert any(".lora_B." in n for n in a) and a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    opt_a, opt_b = straight.trainer.optimizers[0], resumed.trainer.optimizers[0]
    for pa, pb in zip(opt_a.param_groups[0]["params"], opt_b.param_groups[0]["params"]):
        assert opt_a.state[pa]["step"] == opt_b.state[pb]["step"] == 4
        assert torch.equal(opt_a.state[pa]["exp_avg_sq"], opt_b.state[pb]["exp_avg_sq"])


def test_resume_refuses_other_adapters_or_other_training(resumed_runs, run_cli):
    _, _, root = resumed_runs
    checkpoint = torch.load(_last(root / "b"), weights_only=False)
    saved = checkpoint["lightning_logra"]
    assert saved["training"] == lora.TRAINING and saved["lora"]["rank"] == 4
    other = {**saved, "lora": {**saved["lora"], "alpha": 16.0}}
    with pytest.raises(ValueError, match="trainer.strategy.init_args.lora: the checkpoint's adapters"):
        check_resumable(checkpoint, other)
    with pytest.raises(ValueError, match="cannot resume") as info:
        _fit(run_cli, root / "d", 3, "--trainer.strategy.init_args.lora.alpha", "8", "--ckpt_path", _last(root / "b"))
    assert "'alpha': 32.0" in str(info.value) and "'alpha': 8.0" in str(info.value)


def test_export_is_the_merged_model_and_the_adapter_export_loads_in_peft(resumed_runs, run_cli, tiny_arith_model,
                                                                         tmp_path):
    straight, _, root = resumed_runs
    policy = straight.model.policy.eval()
    merged_out = export_checkpoint(_last(root / "a"), tmp_path / "merged")
    adapter_out = export_checkpoint(_last(root / "a"), tmp_path / "adapter", adapter=True)

    exported = AutoModelForCausalLM.from_pretrained(merged_out).eval()
    layers = lora.adapted_layers(policy)
    assert len(layers) == 14
    for name, layer in layers.items():
        a, b, s = (t.double() if torch.is_tensor(t) else t for t in lora.factors(layer))
        expected = layer.base_layer.weight.double() + s * b @ a  # W₀ + s·B·A in float64
        torch.testing.assert_close(exported.get_submodule(name).weight.double(), expected, rtol=0, atol=1e-6)
    base = AutoModelForCausalLM.from_pretrained(tiny_arith_model)
    for name, param in exported.named_parameters():  # nothing else changed
        if name.removesuffix(".weight") not in layers:
            assert torch.equal(param, base.get_parameter(name)), name

    ids = torch.tensor([[3, 4, 13, 5, 6, 14], [9, 8, 13, 7, 7, 14]])
    with torch.no_grad():
        ours = policy(input_ids=ids).logits
        torch.testing.assert_close(exported(input_ids=ids).logits, ours, rtol=0, atol=1e-5)
        with_adapter = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_arith_model),
                                                      str(adapter_out)).eval()
        torch.testing.assert_close(with_adapter(input_ids=ids).logits, ours, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="--adapter: .* was not trained with LoRA adapters"):
        export_checkpoint(_dense_checkpoint(run_cli, tmp_path), tmp_path / "x", adapter=True)


def _dense_checkpoint(run_cli, root):
    run_cli("tiny_arith_dense_all", "--data.init_args.batch_size", "2", "--trainer.val_check_interval", "1",
            "--data.init_args.eval_limit", "2", steps=1, root=root / "dense")
    return _last(root / "dense")


def test_the_low_rank_delta_is_the_change_of_the_merged_weight():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 10, bias=False)).double()
    lora.LoRAConfig(target_modules=["0"], rank=3, alpha=6.0).install(model)
    (name, layer), = lora.adapted_layers(model).items()
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_()
    before_weight, before = lora.merged_weight(layer), lora.adapter_snapshot(model)
    with torch.no_grad():
        layer.lora_A["default"].weight.add_(torch.randn(3, 12, dtype=torch.float64))
        layer.lora_B["default"].weight.add_(torch.randn(10, 3, dtype=torch.float64))
    deltas = lora.low_rank_deltas(model, before)
    delta = deltas[f"{name}.weight"]
    assert delta.factor.shape == (10, 6) and delta.projection().shape == (6, 12)  # rank 2r, not d×k
    engine_weight = before_weight.clone()
    Update.from_bytes(Update(deltas).to_bytes()).low_rank[f"{name}.weight"].apply_(engine_weight)  # as sent
    torch.testing.assert_close(engine_weight, lora.merged_weight(layer), rtol=0, atol=1e-12)
    assert not lora.low_rank_deltas(model, lora.adapter_snapshot(model))  # nothing changed: nothing sent


def test_an_engine_with_its_own_weights_follows_a_controlled_lora_run(run_cli):
    cli = _lora_run(run_cli, 3, "--trainer.strategy.init_args.lora.lr", "1e-2")
    module = cli.model
    module.configure_model()
    module.engine = HFEngine(copy.deepcopy(module.policy), module.stop_token_ids(), pad_token_id(module.tokenizer))
    start = {name: t.clone() for name, t in module.engine.model.state_dict().items()}
    sync = RolloutWeightSync(check_every=1, tolerance=1e-5)
    budget = PredictedKLBudget(budget=1e-3, alpha_max=4.0, subset=4)
    cli.trainer.callbacks.extend([budget, sync])
    cli.trainer.fit(module, cli.datamodule)

    assert sync.syncs == 3 and sync.loads == 0  # the copy equals the trainer at the start and at every check
    metrics = module.trainer.callback_metrics
    assert metrics["sync/bytes"] < metrics["sync/dense_bytes"] / 2  # rank-2r factors, not the matrices
    assert 0 < float(metrics["kl/alpha"]) <= 4.0  # the controller chose every step's α
    ours = lora.engine_tensors(module.policy)
    theirs = module.engine.weights(list(ours))
    assert theirs.keys() == dict(module.engine.model.named_parameters()).keys()  # the base model's names, all
    for name, weight in ours.items():
        torch.testing.assert_close(theirs[name], weight, rtol=0, atol=1e-6, msg=name)
    assert any(not torch.equal(theirs[name], start[name]) for name in theirs)  # the updates did reach the engine
    prompts, greedy = [[3, 4, 13, 5, 6, 14], [9, 8, 13, 7, 7, 14]], SamplingParams(temperature=0.0, max_new_tokens=4)
    trainer_side = HFEngine(module.policy, module.stop_token_ids(), pad_token_id(module.tokenizer))
    assert torch.equal(module.engine.generate(prompts, 1, greedy, [0, 1]).completion_ids,
                       trainer_side.generate(prompts, 1, greedy, [0, 1]).completion_ids)


@pytest.mark.parametrize("settings, message", [
    ({"rank": 0}, "trainer.strategy.init_args.lora.rank must be a positive integer"),
    ({"alpha": -1.0}, "trainer.strategy.init_args.lora.alpha must be a positive number"),
    ({"dropout": 1.0}, "trainer.strategy.init_args.lora.dropout must be in [0, 1)"),
    ({"lr": 0.0}, "trainer.strategy.init_args.lora.lr must be a positive learning rate"),
    ({"lr": float("nan")}, "trainer.strategy.init_args.lora.lr must be a positive learning rate"),
    ({"weight_decay": -0.1}, "trainer.strategy.init_args.lora.weight_decay must be a number ≥ 0"),
    ({"target_modules": []}, "trainer.strategy.init_args.lora.target_modules is empty"),
])
def test_bad_settings_fail_naming_the_key(settings, message):
    with pytest.raises(ValueError) as info:
        lora.LoRAConfig(**settings)
    assert message in str(info.value)


@pytest.mark.parametrize("override, message", [
    (["--trainer.strategy.init_args.lora.target_modules", "[q_proj, w_proj]"],
     "trainer.strategy.init_args.lora.target_modules: 'w_proj' matches no module"),
    (["--trainer.strategy.init_args.lora.rank", "128"],
     "trainer.strategy.init_args.lora.rank: 128 must be smaller than in_features=128"),
    (["--trainer.strategy.init_args.lora.dropout", "1.5"], "trainer.strategy.init_args.lora.dropout must be in"),
    # the dense run's settings are DenseStrategy's: LoRAStrategy has none to ignore
    (["--trainer.strategy.init_args.dense.lr", "0.1"], "unrecognized arguments: --dense.lr"),
], ids=["target", "rank", "dropout", "dense.lr"])
def test_bad_config_values_fail_before_training_naming_the_key(run_cli, tmp_path, capsys, override, message):
    with pytest.raises((ValueError, SystemExit)) as info:
        _fit(run_cli, tmp_path, 2, *override)
    shown = capsys.readouterr().err if info.type is SystemExit else str(info.value)  # parse errors go to stderr
    assert message in shown
    assert not glob.glob(str(tmp_path / "**" / "*.ckpt"), recursive=True)  # no step was taken


def test_dense_baseline_on_the_target_matrices_only(tiny_arith_model):
    def trained(targets):
        policy = AutoModelForCausalLM.from_pretrained(tiny_arith_model)
        DenseMode(Collectives(), DenseConfig(target_modules=targets)).install(policy, fitting=True)
        return sorted(n for n, p in policy.named_parameters() if p.requires_grad)

    assert trained(["q_proj", "down_proj"]) == sorted(f"model.layers.{i}.{m}.weight" for i in range(2)
                                                      for m in ("self_attn.q_proj", "mlp.down_proj"))
    with pytest.raises(ValueError, match="trainer.strategy.init_args.dense.target_modules: 'w_proj' matches no module"):
        trained(["w_proj"])
    with pytest.raises(ValueError, match="trainer.strategy.init_args.dense.target_modules is empty"):
        DenseConfig(target_modules=[])



def test_the_dense_baseline_config_trains_what_the_logra_config_trains(run_cli):
    # Like for like: configs/tiny_arith_dense.yaml trains exactly the weights tiny_arith.yaml sketches; the
    # all-parameter baseline is configs/tiny_arith_dense_all.yaml (it adds the tied embedding, the norms and biases).
    sketched = yaml.safe_load((CONFIGS / "tiny_arith.yaml").read_text())["trainer"]["strategy"]["init_args"]
    targets = sketched["sketch"]["target_modules"]
    trained = {}
    for name in ("tiny_arith_dense", "tiny_arith_dense_all"):
        cli = run_cli(name, fast=False, run=False)
        policy = AutoModelForCausalLM.from_pretrained(model_path(cli.model.hparams.model))
        training_mode(cli.trainer.strategy, Collectives()).install(policy, fitting=True)  # what a fit trains
        trained[name] = {n for n, p in policy.named_parameters() if p.requires_grad}
    params = dict(policy.named_parameters())
    assert trained["tiny_arith_dense"] == {n for n in params if n.rsplit(".", 2)[-2] in targets and
                                           n.endswith(".weight")}
    assert trained["tiny_arith_dense_all"] == params.keys()
    # what only the all-parameter baseline trains: the tied embedding/head, 9 norms, the q/k/v biases
    assert sum(params[n].numel() for n in params.keys() - trained["tiny_arith_dense"]) == 4608
