"""A vLLM engine placed on one rank of several (`VLLMEngine.place`), before it starts: the settings that cannot work
fail naming the key, and the environment its processes inherit keeps the trainer's rank and rendezvous out. (The
engines themselves, 2 ranks with one each: tests/integration/vllm/test_ddp_vllm.py and test_fsdp_vllm.py.)"""

import os

import pytest
import torch

from lightning_logra.rollout import VLLMEngine

TRAINER = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "NODE_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "none", "GROUP_RANK": "0"}


def test_an_engine_in_the_trainers_process_is_refused_with_several_ranks():
    with pytest.raises(ValueError, match="engine.separate_process: true"):
        VLLMEngine(separate_process=False).place(1, 2, torch.device("cpu"))
    VLLMEngine(separate_process=False).place(0, 1, torch.device("cpu"))  # one process: as before


def test_a_tensor_parallel_engine_is_refused_with_several_ranks():
    with pytest.raises(ValueError, match=r"engine.tensor_parallel_size: 1 \(got 2\)"):
        VLLMEngine(tensor_parallel_size=2).place(0, 2, torch.device("cpu"))


def test_engines_in_the_trainers_ranks_need_whole_groups_of_ranks():
    with pytest.raises(ValueError, match="engine.placement must be one of processes, trainer_ranks"):
        VLLMEngine(placement="rank0")
    with pytest.raises(ValueError, match=r"one engine per 2 consecutive ranks .* 3 ranks are not a multiple"):
        VLLMEngine(placement="trainer_ranks", tensor_parallel_size=2).place(0, 3, torch.device("cpu"))
    # one worker per rank: no group to gather prompts in, and no process of its own whatever separate_process says
    engine = VLLMEngine(placement="trainer_ranks", separate_process=True)
    engine.place(1, 2, torch.device("cpu"))
    assert engine.in_trainer_ranks and engine.group is None and engine.group_ranks == [1]
    assert not engine.separate_process


def test_an_engine_in_the_trainers_ranks_starts_with_them(monkeypatch):
    # vLLM's external launcher reads the rank from RANK, which Lightning's launcher does not set; the rendezvous
    # stays (vLLM joins the trainer's process group).
    for name, value in TRAINER.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)  # vLLM sets it in a process that started one
    engine = VLLMEngine(placement="trainer_ranks")
    engine.place(1, 2, torch.device("cpu"))
    with engine._environment():
        assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("1", "2", "1")
        assert os.environ["MASTER_PORT"] == "29500" and "VLLM_WORKER_MULTIPROC_METHOD" not in os.environ
    assert "RANK" not in os.environ


def test_the_engine_starts_without_the_trainers_rank_and_rendezvous(monkeypatch):
    for name, value in TRAINER.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("VLLM_PORT", "40000")
    monkeypatch.setenv("PYTHONPATH", "/somewhere")  # not the trainer's to keep
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    engine = VLLMEngine()
    engine.place(1, 2, torch.device("cpu"))
    before = dict(os.environ)
    with engine._environment():
        assert not set(TRAINER) & set(os.environ)
        assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
        assert os.environ["VLLM_PORT"] == "40100"  # rank 1 looks for free ports 100 above rank 0
        assert os.environ["PYTHONPATH"] == "/somewhere"
    assert dict(os.environ) == before  # the trainer's own environment is back as it was


def test_one_process_starts_its_engine_in_the_environment_as_it_is(monkeypatch):
    for name, value in TRAINER.items():
        monkeypatch.setenv(name, value)
    before = dict(os.environ)
    engine = VLLMEngine()
    engine.place(0, 1, torch.device("cpu"))
    with engine._environment():
        assert dict(os.environ) == before


def test_each_ranks_cpu_engine_gets_its_own_cores(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-3|4-7")
    engine = VLLMEngine()
    engine.place(1, 2, torch.device("cpu"))
    with engine._environment():
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "4-7"
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0-3|4-7"
    engine.place(1, 3, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"VLLM_CPU_OMP_THREADS_BIND: 2 core lists for 3 ranks"):
        with engine._environment():
            pass


def test_under_sharded_training_each_rank_places_an_engine_of_its_own(tiny_arith_model, monkeypatch):
    # SketchFSDPStrategy: each rank's engine is placed beside it and started from the model's files (the weight sync
    # then compares it with the trainer's shards: tests/integration/vllm/test_fsdp_vllm.py).
    from types import SimpleNamespace

    from lightning.pytorch.trainer.states import TrainerFn

    from lightning_logra.train.module import RLVRModule
    from lightning_logra.train.strategies.fsdp import SketchFSDPStrategy

    started = []
    monkeypatch.setattr(VLLMEngine, "start", lambda self, model, pad, stop: started.append(model))
    engine = VLLMEngine()
    module = RLVRModule(tiny_arith_model, reward="exact_match", rollouts={"engine": engine})
    module._trainer = SimpleNamespace(world_size=2, global_rank=1, strategy=SketchFSDPStrategy(),
                                      state=SimpleNamespace(fn=TrainerFn.FITTING), log_dir=None)
    monkeypatch.setattr(SketchFSDPStrategy, "root_device", torch.device("cpu"))
    module.configure_model()
    assert (engine.rank, engine.world_size, engine.device) == (1, 2, torch.device("cpu"))
    assert started == [str(tiny_arith_model)]
