"""`perf/*` (`train/throughput.py`): tokens per second by the counts, the parts' shares of the step adding up to one,
N as the forward pass multiplies by it, and the update's MFU by its formula. (Every run logs them:
tests/integration/vllm/test_overlap.py.)"""

import math

import pytest
import torch

from conftest import make_tiny_qwen2
from lightning_logra.base.batch import Rollout
from lightning_logra.train.throughput import Throughput, matmul_parameters, peak_flops, throughput_metrics, update_mfu


def test_tokens_per_second_and_each_parts_share_of_the_step():
    # the predicted-KL check (kl/control_s) runs inside the update's time, the realized KL after the sync
    seconds = {"train/wait_s": 2.0, "train/score_s": 0.5, "train/update_s": 5.0, "kl/control_s": 1.0,
               "kl/realized_s": 0.5, "train/sync_s": 1.0}
    metrics = throughput_metrics(generated=300, trained=1000, step_s=10.0, seconds=seconds, mfu=None)
    assert metrics["perf/generated_tokens_per_s"] == 30.0 and metrics["perf/trained_tokens_per_s"] == 100.0
    shares = {key.removeprefix("perf/share/"): value for key, value in metrics.items() if "share" in key}
    assert shares == pytest.approx({"generation": 0.2, "scoring": 0.05, "update": 0.4, "kl": 0.15, "sync": 0.1,
                                    "other": 0.1})
    assert "perf/mfu" not in metrics
    # no KL check (or a skipped update's NaN), no sync: those parts are 0
    bare = throughput_metrics(1, 1, 4.0, {"train/wait_s": 1.0, "train/score_s": 1.0, "train/update_s": 1.0,
                                          "kl/control_s": math.nan}, mfu=0.25)
    assert bare["perf/share/kl"] == bare["perf/share/sync"] == 0.0 and bare["perf/share/other"] == 0.25
    assert bare["perf/mfu"] == 0.25


def test_n_counts_what_a_token_is_multiplied_by():
    model = make_tiny_qwen2()  # tied embedding and head: the table counts once, as the head
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert matmul_parameters(model) == sum(p.numel() for p in model.parameters())
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    embedding = model.get_input_embeddings().weight.numel()
    assert matmul_parameters(model) == sum(p.numel() for p in model.parameters()) - embedding


def test_the_updates_mfu_by_its_formula():
    assert update_mfu(parameters=10**9, tokens=4096, update_s=2.0, peak=989.4e12) == pytest.approx(
        6 * 10**9 * 4096 / (2.0 * 989.4e12))
    assert update_mfu(10**9, 4096, 2.0, None) is None
    assert peak_flops(torch.device("cpu"), torch.float32) is None  # no peak on the CPU: no perf/mfu


def test_a_steps_counts_over_the_ranks():
    rollout = Rollout(prompt_ids=torch.ones(2, 3, dtype=torch.long),
                      prompt_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]),
                      completion_ids=torch.ones(2, 4, dtype=torch.long),
                      completion_mask=torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]]),
                      sampler_logprobs=torch.zeros(2, 4))
    throughput = Throughput(make_tiny_qwen2(), torch.device("cpu"))
    seconds = {"train/wait_s": 1.0, "train/score_s": 0.0, "train/update_s": 1.0}
    two_ranks, tokens = throughput.metrics(rollout, lambda t: 2 * t, step_s=2.0, seconds=seconds)  # a rank alike
    assert two_ranks["perf/generated_tokens_per_s"] == 2 * 6 / 2.0
    assert two_ranks["perf/trained_tokens_per_s"] == 2 * (5 + 6) / 2.0 and tokens == 2 * (5 + 6)
