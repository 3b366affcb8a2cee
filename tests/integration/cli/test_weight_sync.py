"""Seed-based weight sync without vLLM: the payload, its bytes, shards, fingerprints, importance weights, and a
rollout engine with its own weight copy following the trainer through real training steps."""

import copy
import math
from dataclasses import astuple
from functools import partial

import pytest
import torch
from lightning.pytorch import Callback, Trainer

from conftest import SKETCH_TARGETS, EngineSnapshot
from lightning_logra.algo.losses import importance_weights
from lightning_logra.algo.update import Update
from lightning_logra.callbacks import PredictedKLBudget, RolloutWeightSync
from lightning_logra.data.module import ArithDataModule
from lightning_logra.rollout import HFEngine, fingerprint
from lightning_logra.sketch import SketchAdam
from lightning_logra.sketch.config import SketchConfig
from lightning_logra.sketch.update import LowRankDelta
from lightning_logra.train.module import RLVRModule
from lightning_logra.train.policy import pad_token_id
from lightning_logra.train.strategies import SketchStrategy


def _delta(d, k, r, seed):
    return LowRankDelta(torch.randn(d, r, generator=torch.Generator().manual_seed(seed)), 1000 + seed, "rademacher", k)


def test_payload_bytes_are_d_times_r_numbers_plus_a_small_header():
    shapes = [(128, 128), (384, 128), (128, 384)] * 4
    payload = Update({f"m{i}.weight": _delta(d, k, 16, i) for i, (d, k) in enumerate(shapes)})
    expected = sum(d * 16 * 4 for d, _ in shapes)
    assert payload.tensor_bytes == expected
    data = payload.to_bytes()
    assert 0 < len(data) - expected < 256 * len(shapes)  # names, seeds, dtypes, offsets
    halved = Update({n: LowRankDelta(d.factor.bfloat16(), d.seed, d.distribution, d.in_features, 7)
                          for n, d in payload.low_rank.items()})
    assert halved.tensor_bytes == expected // 2

    back = Update.from_bytes(halved.to_bytes())
    payload = halved
    assert back.low_rank.keys() == payload.low_rank.keys()
    for name, delta in payload.low_rank.items():
        got = back.low_rank[name]
        assert (got.seed, got.distribution, got.in_features, got.rounding_key) == (
            delta.seed, delta.distribution, delta.in_features, delta.rounding_key)
        assert torch.equal(got.factor, delta.factor)


def test_dense_tensors_travel_whole():
    payload = Update(dense={"model.norm.weight": torch.arange(6.0)})
    back = Update.from_bytes(payload.to_bytes())
    assert torch.equal(back.dense["model.norm.weight"], torch.arange(6.0)) and not back.low_rank
    assert not Update()


def test_shards_merge_to_the_full_update():
    # Column-parallel ranks hold row blocks, row-parallel ranks column blocks: F[rows]·A and F·A[:, cols].
    delta = _delta(12, 10, 3, 0)
    weight = torch.randn(12, 10, dtype=torch.float64)
    full = weight.clone()
    delta.apply_(full)
    torch.testing.assert_close(full, weight - delta.factor.double() @ delta.projection().double())
    by_rows, by_cols = weight.clone(), weight.clone()
    for rows in (slice(0, 5), slice(5, 12)):
        delta.apply_shard_(by_rows[rows], rows, slice(0, 10))
    for cols in (slice(0, 4), slice(4, 10)):
        delta.apply_shard_(by_cols[:, cols], slice(0, 12), cols)
    assert torch.equal(by_rows, full) and torch.equal(by_cols, full)


def test_fingerprint_sees_a_single_entry_change_exactly():
    weight = torch.randn(6, 9)
    drifted = weight.clone()
    drifted[4, 7] += 1e-3
    change = fingerprint(drifted, seed=3) - fingerprint(weight, seed=3)
    assert change[4].abs().item() == pytest.approx(1e-3, rel=1e-3)  # float32 entry, exact ±1 weight
    assert torch.equal(change[[0, 1, 2, 3, 5]], torch.zeros(5, dtype=torch.float64))
    # Column blocks add up to the whole (a row-parallel shard's fingerprint is a partial sum).
    parts = fingerprint(weight[:, :4], 3, col_start=0) + fingerprint(weight[:, 4:], 3, col_start=4)
    torch.testing.assert_close(parts, fingerprint(weight, 3), rtol=0, atol=1e-12)


def _sharded_fingerprints(rank: int, port: int, out: str) -> None:
    """One of 2 gloo processes: a (5, 7) weight and a (5,) norm sharded by rows as FSDP2 shards them (uneven: 3 + 2
    rows), their gathered fingerprints and whole values, saved for the test."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_logra.rollout.sync import whole, whole_fingerprint

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    tensors = {"weight": torch.randn(5, 7, generator=torch.Generator().manual_seed(0)),
               "norm": torch.randn(5, generator=torch.Generator().manual_seed(1))}
    result = {}
    for name, tensor in tensors.items():
        sharded = distribute_tensor(tensor, mesh, [Shard(0)])
        result[name] = (tensor, whole_fingerprint(sharded, seed=11), whole(sharded), sharded.to_local().shape[0])
    torch.save(result, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def _restart_under_sharding(rank: int, port: int, out: str) -> None:
    """One gloo process: a sync attached to an engine whose trainer tensors are DTensors (as under FSDP), then the
    engine's restart asks it to reload; what it raised is saved for the test."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_logra.rollout.engine import RolloutEngine

    class Files(RolloutEngine):  # an engine holding what the trainer holds: nothing to load at the start
        def __init__(self, tensors):
            self.tensors, self.loaded = tensors, []

        def generate(self, *args):
            raise NotImplementedError

        def load_weights(self, tensors):
            self.loaded.append(sorted(tensors))
            return 0

        def apply_update(self, update):
            return 0

        def fingerprints(self, names, seed):
            return {name: fingerprint(self.tensors[name], seed) for name in names}

        def weights(self, names):
            return {name: self.tensors[name] for name in names}

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=1)
    weight = torch.randn(4, 3)
    sharded = {"w": distribute_tensor(weight, init_device_mesh("cpu", (1,)), [Shard(0)])}
    engine = Files({"w": weight})
    sync = RolloutWeightSync()
    sync.attach(engine, lambda: sharded, lambda values: values)
    try:
        engine._reload()  # what VLLMEngine.restart calls once a new engine is up
        raised = None
    except RuntimeError as err:
        raised = str(err)
    torch.save({"raised": raised, "loaded": engine.loaded, "loads": sync.loads}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def test_a_restarted_engine_under_sharded_training_stops_the_run_saying_how_to_resume(tmp_path):
    # Its reload would need every rank to gather every tensor while the others are elsewhere in the step: the run
    # stops rather than generate from the model's files.
    from conftest import spawn_ranks

    (result,) = spawn_ranks(_restart_under_sharding, tmp_path, nprocs=1)
    assert result["loaded"] == [] and result["loads"] == 0  # the start found the engine equal
    assert "under sharded training (FSDP)" in result["raised"] and "--ckpt_path" in result["raised"]


def test_fingerprints_of_sharded_tensors_are_gathered_rows_not_weights(tmp_path):
    # Under FSDP a rank fingerprints its rows and all-gathers the d numbers: exactly the whole tensor's fingerprint.
    from conftest import spawn_ranks

    for rank, result in enumerate(spawn_ranks(_sharded_fingerprints, tmp_path)):
        for name, (tensor, gathered, value, local_rows) in result.items():
            assert local_rows == (3, 2)[rank]  # each rank held its rows only
            assert torch.equal(gathered, fingerprint(tensor, seed=11)), name
            assert torch.equal(value, tensor), name


def test_importance_weights_truncate_and_measure_the_mismatch():
    trainer = torch.tensor([[-1.0, -2.0, -0.5, 0.0]])
    sampler = torch.tensor([[-1.0, -3.0, -0.1, -9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    weight, stats = importance_weights(trainer, sampler, mask, cap=2.0)
    delta = torch.tensor([0.0, 1.0, -0.4])
    torch.testing.assert_close(weight[0], torch.tensor([1.0, 2.0, float(torch.exp(torch.tensor(-0.4))), 0.0]))
    k3 = (delta.exp() - 1 - delta).sum()
    applied = torch.tensor([1.0, 2.0, float(torch.exp(torch.tensor(-0.4)))])
    torch.testing.assert_close(torch.stack(astuple(stats)), torch.stack([
        delta.abs().sum(), k3, torch.tensor(1.0), torch.tensor(3.0), applied.sum(), applied.min(), applied.max()]))
    # model.rollouts.is_cap: null turns the correction off (README, docs/vllm.md): every real token weighs 1, not the
    # ratio e
    off, off_stats = importance_weights(trainer, sampler, mask, cap=None)
    assert off[0].tolist() == [1.0, 1.0, 1.0, 0.0]
    torch.testing.assert_close(torch.stack(astuple(off_stats)), torch.stack([
        delta.abs().sum(), k3, torch.tensor(0.0), torch.tensor(3.0), torch.tensor(3.0), torch.tensor(1.0),
        torch.tensor(1.0)]))


def _module(model_path, engine=None, dtype="float32", **rollouts):
    """A module on `model_path`; `rollouts`: settings of model.rollouts beside the engine."""
    return RLVRModule(model_path, reward="conftest.odd_first_digit", dtype=dtype,
                      sampling={"num_generations": 4, "max_new_tokens": 4}, training={"micro_batch_size": 16},
                      rollouts={"engine": engine, **rollouts})


def _trainer(root, callbacks, steps=3, refresh_every=None):
    sketch = SketchConfig(SKETCH_TARGETS, rank=8, optimizer=partial(SketchAdam, lr=1e-2, refresh_every=refresh_every))
    return Trainer(
        accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=root,
        strategy=SketchStrategy(sketch),
        callbacks=callbacks,
    )


@pytest.mark.parametrize(("refresh_every", "dtype"), [(None, "float32"), (1, "float32"), (None, "bfloat16")],
                         ids=["fixed", "refreshed every step", "bf16 stochastic rounding"])
def test_an_engine_with_its_own_weights_follows_training_exactly(tiny_arith_model, tmp_path, refresh_every, dtype):
    # The same 3 steps, once generating with the policy itself and once with a separate copy kept in step only
    # by sync payloads: the copy must hold the trainer's weights, and the two runs must train identically.
    # Refreshed every step, each payload must carry the seed of the projection it was merged with, not the next.
    # In bf16 the engine must draw the trainer's rounding bits: its weights are then equal bit for bit.
    torch.manual_seed(0)
    shared = _module(tiny_arith_model, dtype=dtype)
    _trainer(tmp_path / "a", [PredictedKLBudget(budget=1e-3, alpha_max=4.0, subset=4)], 3, refresh_every).fit(
        shared, ArithDataModule(batch_size=4))

    separate = _module(tiny_arith_model, dtype=dtype)
    separate.configure_model()
    copy_model = copy.deepcopy(separate.policy)
    separate.engine = HFEngine(copy_model, separate.stop_token_ids(), pad_token_id(separate.tokenizer))
    sync, capture = RolloutWeightSync(check_every=1), EngineSnapshot()
    _trainer(tmp_path / "b", [PredictedKLBudget(budget=1e-3, alpha_max=4.0, subset=4), sync, capture], 3,
             refresh_every).fit(separate, ArithDataModule(batch_size=4))

    assert sync.syncs == 3 and sync.loads == 0  # the copy equals the trainer at the start and at every check
    atol = 0.0 if dtype == "bfloat16" else 1e-6
    for name, ours in capture.trainer_weights.items():
        assert ours.dtype == getattr(torch, dtype)
        torch.testing.assert_close(capture.engine_weights[name], ours, rtol=0, atol=atol, msg=name)
        torch.testing.assert_close(ours, shared.policy.state_dict()[name], rtol=0, atol=atol, msg=name)
    assert torch.equal(capture.engine_greedy, capture.trainer_greedy)


def _separate_engine(model_path):
    """A module whose engine is an in-process copy of the policy, kept in step only by the sync."""
    module = _module(model_path)
    module.configure_model()
    module.engine = HFEngine(copy.deepcopy(module.policy), module.stop_token_ids(), pad_token_id(module.tokenizer))
    return module, module.engine


def test_drift_is_detected_and_repaired(tiny_arith_model, tmp_path):
    module, engine = _separate_engine(tiny_arith_model)
    sync = RolloutWeightSync(check_every=None, tolerance=1e-5)
    trained, untrained = "model.layers.1.mlp.down_proj.weight", "model.norm.weight"

    class Drift(Callback):
        def on_train_end(self, trainer, pl_module):
            assert sync.check() == 0.0
            engine.model.get_parameter(trained).data[3, 5] += 1e-3  # e.g. a bit flip or a lost payload
            self.found_trained = sync.check()
            engine.model.get_parameter(untrained).data[7] += 0.5  # a tensor no update ever touches
            self.found_untrained = sync.check()
            self.after = sync.max_abs_diff()

    drift = Drift()
    _trainer(tmp_path, [sync, drift], steps=2).fit(module, ArithDataModule(batch_size=4))
    assert drift.found_trained == pytest.approx(1e-3, rel=1e-3)
    assert drift.found_untrained == pytest.approx(0.5, rel=1e-6)
    assert drift.after == 0.0 and sync.loads == 2  # the two repairs


def test_a_sampler_far_from_the_trainer_triggers_a_check(tiny_arith_model, tmp_path):
    # No periodic check: only the log-prob mismatch can reveal that the engine's final norm was shifted.
    module, engine = _separate_engine(tiny_arith_model)
    sync = RolloutWeightSync(check_every=None, tolerance=1e-5, logprob_diff_threshold=1e-3, logprob_diff_steps=2)

    class Drift(Callback):
        def on_train_start(self, trainer, pl_module):
            self.diffs = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 0:  # after the start's comparison (the module's on_train_start)
                engine.model.get_parameter("model.norm.weight").data += 0.5

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.diffs.append(float(trainer.callback_metrics["rollout/logprob_abs_diff"]))
            self.loads = getattr(self, "loads", []) + [sync.loads]

    drift = Drift()
    _trainer(tmp_path, [sync, drift], steps=4).fit(module, ArithDataModule(batch_size=4))
    assert min(drift.diffs[:2]) > 1e-3 and max(drift.diffs[2:]) < 1e-5  # repaired after 2 steps above 1e-3
    assert drift.loads == [0, 1, 1, 1]
    assert sync.max_abs_diff() == 0.0


def test_a_load_sends_only_what_differs_a_chunk_at_a_time(tiny_arith_model, monkeypatch):
    # The start compares, then loads only the tensors that differ, never more than a chunk (or one larger tensor) per
    # call: under FSDP each rank holds no more than that of gathered tensors beside its shards.
    import lightning_logra.callbacks.weight_sync as weight_sync

    module = _module(tiny_arith_model)
    module.configure_model()
    engine = HFEngine(copy.deepcopy(module.policy), module.stop_token_ids(), pad_token_id(module.tokenizer))
    calls = []
    load = engine.load_weights
    engine.load_weights = lambda tensors: calls.append({n: t.numel() * 4 for n, t in tensors.items()}) or load(tensors)
    tensors = module.mode.engine_tensors(module.policy)
    changed = [name for name in tensors if "layers.1." in name]
    for name in changed:
        tensors[name].add_(1e-3)  # as a resumed checkpoint differs from the model's files
    limit = 40_000  # bytes: this model's matrices are 64-128 KB, its norms and biases 0.5 KB
    monkeypatch.setattr(weight_sync, "_LOAD_CHUNK_BYTES", limit)
    sync = RolloutWeightSync()
    sync.attach(engine, lambda: module.mode.engine_tensors(module.policy), lambda values: values)
    assert sorted(name for call in calls for name in call) == sorted(changed) and sync.loads == 1
    for call in calls:  # a chunk stops at the first tensor that reaches the limit
        assert sum(call.values()) - max(call.values()) < limit
    assert len(calls) > 1 and sync.max_abs_diff() == 0.0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_skipped_update_sends_nothing_and_the_engine_stays_equal(tiny_arith_model, tmp_path, dtype):
    # A NaN in step 2's sketch skips that update: nothing is merged, nothing is sent (sync/bytes is NaN, not step 1's
    # value repeated), and after step 3 the engine still holds the trainer's weights — in bf16 bit for bit, which
    # needs the rounding counter to have skipped that step on both sides.
    from conftest import PoisonSketchAt

    class Record(Callback):
        def __init__(self):
            self.sent = []

        def on_train_batch_end(self, trainer, pl_module, *_):
            self.sent.append(float(trainer.callback_metrics["sync/bytes"]))

    module = _module(tiny_arith_model, dtype=dtype)
    module.configure_model()
    module.engine = HFEngine(copy.deepcopy(module.policy), module.stop_token_ids(), pad_token_id(module.tokenizer))
    sync, record, capture = RolloutWeightSync(check_every=None), Record(), EngineSnapshot()
    _trainer(tmp_path, [PoisonSketchAt(1), sync, record, capture]).fit(module, ArithDataModule(batch_size=4))
    assert sync.syncs == 2 and module.trainer.optimizers[0].updates == 2
    first, skipped, third = record.sent
    assert first > 0 and third > 0 and math.isnan(skipped)
    for name, ours in capture.trainer_weights.items():
        assert torch.equal(capture.engine_weights[name], ours), name


def test_an_engine_with_its_own_weights_needs_the_sync(tiny_arith_model, tmp_path):
    # Without RolloutWeightSync it would sample from the initial weights forever, silently.
    module = _module(tiny_arith_model)
    module.configure_model()
    module.engine = HFEngine(copy.deepcopy(module.policy), module.stop_token_ids(), pad_token_id(module.tokenizer))
    trainer = _trainer(tmp_path, [])
    with pytest.raises(ValueError, match="add lightning_logra.callbacks.RolloutWeightSync"):
        trainer.fit(module, ArithDataModule(batch_size=4))
    assert trainer.global_step == 0


def test_sync_refuses_the_engine_that_shares_the_policy(tiny_arith_model, tmp_path):
    with pytest.raises(ValueError, match="nothing to sync"):
        _trainer(tmp_path, [RolloutWeightSync()]).fit(_module(tiny_arith_model), ArithDataModule(batch_size=4))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"check_every": 0}, "check_every"),
    ({"tolerance": -1.0}, "tolerance"),
    ({"logprob_diff_threshold": 0.0}, "logprob_diff_threshold"),
    ({"logprob_diff_steps": 0}, "logprob_diff_steps"),
])
def test_bad_sync_settings_fail_fast(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RolloutWeightSync(**kwargs)


def test_bad_importance_cap_fails_fast(tiny_arith_model):
    with pytest.raises(ValueError, match="model.rollouts.is_cap"):
        _module(tiny_arith_model, is_cap=0.0)
