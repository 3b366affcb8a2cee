"""What a number is (base/settings.py): for a setting, a finite int or float, not a bool (`is_number`); for a reward,
one real number (`real_number`), which a reward function and an environment's reward() are held to alike."""

import math

import numpy
import pytest
import torch

from lightning_logra.base.settings import is_number, real_number
from lightning_logra.episodes.environment import finite_reward
from lightning_logra.rewards.scoring import reward_tensor

REAL = [(1, 1.0), (0.5, 0.5), (True, 1.0), (numpy.bool_(False), 0.0), (numpy.float32(0.25), 0.25),
        (numpy.int64(3), 3.0), (torch.tensor(0.5), 0.5), (torch.tensor(True), 1.0), (torch.tensor(2), 2.0)]
NOT_REAL = ["0.5", b"1", [1.0], 1j, numpy.complex64(1), numpy.array([1.0]), torch.tensor([1.0]), torch.tensor(1j)]


@pytest.mark.parametrize("value, number", REAL)
def test_a_reward_function_and_an_environment_take_the_same_real_numbers(value, number):
    # An environment's reward() was refused a bool, numpy's bool and a 0-d tensor, which a reward function may return
    assert real_number(value) == number
    assert finite_reward(value, "pkg.Env.reward() returned") == number
    assert reward_tensor([[value]], ["r"], [1.0], 1, 1)[0].tolist() == [number]


@pytest.mark.parametrize("value", NOT_REAL)
def test_a_reward_function_and_an_environment_refuse_the_same_values(value):
    assert real_number(value) is None
    with pytest.raises(ValueError, match=r"pkg.Env.reward\(\) returned .* it must return a real number"):
        finite_reward(value, "pkg.Env.reward() returned")
    with pytest.raises(ValueError, match="a reward must be a number"):
        reward_tensor([[value]], ["r"], [1.0], 1, 1)


@pytest.mark.parametrize("value", [math.nan, math.inf, 10**400, numpy.float32("nan"), torch.tensor(-math.inf)])
def test_a_reward_that_is_not_finite_fails_an_environment_and_drops_a_reward_function_s_group(value):
    assert not math.isfinite(real_number(value))  # 10**400 is past a float: inf (float() raised OverflowError)
    with pytest.raises(ValueError, match="it must return a real number"):
        finite_reward(value, "pkg.Env.reward() returned")
    rewards, _, _, dropped = reward_tensor([[value, 1.0]], ["r"], [1.0], 1, 2)
    assert rewards.tolist() == [0.0, 0.0] and dropped.tolist() == [True]


def test_an_int_past_a_float_is_a_whole_number_but_no_float_and_a_bool_is_neither():
    # math.isfinite(10**400) raised OverflowError: a server's 500 for a temperature written as a 401-digit integer
    assert is_number(10**400, integer=True) and not is_number(10**400) and not is_number(-(10**400))
    assert is_number(3, integer=True) and is_number(0.5) and not is_number(0.5, integer=True)
    assert not is_number(True) and not is_number(math.nan) and not is_number("1")
