"""The metrics a TRL user looks for, each checked against what it must equal: token entropy, completion lengths and
how they ended, tokens seen, the step actually taken (α·η), and completions logged as text."""

import math

import pytest
import torch

from lightning_logra.algo.logprobs import token_entropy
from lightning_logra.base.batch import Rollout


def test_token_entropy_equals_the_float64_definition():
    logits = torch.randn(3, 5, 11, dtype=torch.float64) * 3
    for temperature in (1.0, 0.7):
        p = torch.softmax(logits / temperature, -1)
        expected = -(p * p.log()).sum(-1)
        torch.testing.assert_close(token_entropy(logits.float(), temperature).double(), expected, rtol=1e-5,
                                   atol=1e-6)
    assert float(token_entropy(torch.zeros(1, 1, 11))) == pytest.approx(math.log(11))  # uniform: log V


def test_terminated_means_the_last_real_token_is_a_stop_token():
    eos, pad = 2, 0
    ids = torch.tensor([[5, 6, eos, pad], [5, 6, 7, 8], [eos, pad, pad, pad], [5, pad, pad, pad]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 0, 0, 0]])
    rollout = Rollout(torch.ones(4, 1, dtype=torch.long), torch.ones(4, 1, dtype=torch.long), ids, mask,
                      torch.zeros(4, 4))
    assert rollout.terminated([eos]).tolist() == [True, False, True, False]
