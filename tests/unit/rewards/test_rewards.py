import logging
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from typing import get_args

import numpy
import psutil
import pytest
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from transformers import AutoTokenizer

import bad_rewards
from lightning_logra import rewards
from lightning_logra.rewards import (
    CheckPool,
    MathAnswer,
    RewardName,
    TimedReward,
    exact_match,
    extract_final_answer,
    get_reward,
    math_answer,
    resolve_reward,
    resolve_rewards,
)
from lightning_logra.rewards.scoring import reward_metrics, reward_tensor
from lightning_logra.train.module import RLVRModule


def test_exact_match_strips_whitespace_and_ignores_other_columns():
    scores = exact_match(["12+34=", "57+68=", "10+10="], [" 64\n", "512", "02"], answer=["64", "521", "02"],
                         level=[1, 2, 3])
    assert scores == [1.0, 0.0, 1.0]


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        (r"so x = \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),  # nested braces stay inside the box
        (r"first \boxed{3}, then corrected: \boxed{4}", "4"),  # the last box is the final answer
        ("work...\nAnswer: 12", "12"),  # DAPO-Math style
        ("work...\n**Answer:** $\\frac{3}{4}$\n", "$\\frac{3}{4}$"),  # markdown bold around the label
        ("Answer: 1\nwait, no.\nAnswer: 2", "2"),
        (r"cut off inside the box \boxed{\frac{1}{2" + "\nAnswer: 7", "7"),  # an unclosed box is no answer
        ("the answer is probably 5", None),
    ],
)
def test_extract_final_answer(completion, expected):
    assert extract_final_answer(completion) == expected


@pytest.mark.parametrize(
    ("completion", "gold", "expected"),
    [
        (r"The answer is \boxed{34}.", "34", 1.0),
        (r"The answer is \boxed{35}.", "34", 0.0),
        ("Let me compute.\nAnswer: 34", "34", 1.0),
        ("Let me compute.\nAnswer: $34$", "34", 1.0),
        ("Let me compute.\nAnswer: 43", "34", 0.0),
        (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
        ("Answer: \\frac{1}{2}", "0.5", 1.0),
        (r"\boxed{\sqrt{8}}", r"2\sqrt{2}", 1.0),
        (r"\boxed{\sqrt{7}}", r"2\sqrt{2}", 0.0),
        (r"\boxed{(3, \pi/2)}", r"\left( 3, \frac{\pi}{2} \right)", 1.0),
        ("34, I think", "34", 0.0),  # no box and no Answer line: nothing to judge
        (r"\boxed{}", "34", 0.0),
    ],
)
def test_math_answer(completion, gold, expected):
    assert math_answer(["prompt"], [completion], answer=[gold], solution=["ignored"]) == [expected]


def test_math_answer_takes_numeric_gold():
    assert math_answer(["p"], [r"\boxed{12}"], answer=[12]) == [1.0]


def _as_messages(completions):
    """TRL's conversational form of completions: each a list of one assistant message."""
    return [[{"role": "assistant", "content": completion}] for completion in completions]


def test_built_in_rewards_take_conversational_completions():
    completions = [" 64\n", "512", r"so \boxed{0.5}"]
    answers = ["64", "521", r"\frac{1}{2}"]
    assert exact_match(["p"] * 3, _as_messages(completions), answer=answers) == [1.0, 0.0, 0.0]
    assert math_answer(["p"] * 3, _as_messages(completions), answer=answers) == [0.0, 0.0, 1.0]
    assert MathAnswer()([[{"role": "user", "content": "1/2?"}]], _as_messages([r"\boxed{0.5}"]),
                        answer=["1/2"]) == [1.0]


def _in_thread(fn, *args, **kwargs):
    """fn's return value, computed on a thread other than the main one (as Lightning and loaders may call it);
    an exception in the thread is re-raised here."""
    outcome = {}

    def target():
        try:
            outcome["value"] = fn(*args, **kwargs)
        except BaseException as error:
            outcome["error"] = error

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def test_math_answer_off_the_main_thread():
    # math-verify's own timeout (signal.alarm) raises or does nothing here; ours must still judge correctly.
    completions = [r"\boxed{\frac{1}{2}}", r"\boxed{0.25}", "Answer: 2\\sqrt{2}"]
    scores = _in_thread(math_answer, ["p"] * 3, completions, answer=["0.5", "0.5", r"\sqrt{8}"])
    assert scores == [1.0, 0.0, 1.0]


def test_math_answer_cuts_off_a_slow_check_and_recovers(caplog):
    # A real pathological answer, not a mock: sympy tries to settle 10^(10^10) = 1 and does not return for
    # minutes (math-verify's own alarm-based timeout, which cannot be used on this thread, is what normally stops
    # it). The check must be abandoned at the timeout and score 0.0, while the other worker judges the other answers;
    # the next batch finds a working pool. The settings are set as a config sets them, through the class's init_args.
    reward = MathAnswer(timeout_s=1.0, workers=2)
    completions = [r"\boxed{10^{10^{10}}}", r"\boxed{2}", r"\boxed{0.5}", "Answer: 3", r"\boxed{\sqrt{8}}"]
    answers = ["1", "2", r"\frac{1}{2}", "4", r"2\sqrt{2}"]
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="lightning_logra.rewards"):
        scores = _in_thread(reward, ["p"] * 5, completions, answer=answers)
    elapsed = time.monotonic() - start
    assert scores == [0.0, 1.0, 1.0, 0.0, 1.0]
    assert any("exceeded 1.0 s" in record.getMessage() for record in caplog.records)
    # 1 s of timeout plus starting the verifier processes; the uncut check would take minutes.
    assert elapsed < 30
    assert reward(["p"] * 2, [r"\boxed{7}", r"\boxed{8}"], answer=["7", "9"]) == [1.0, 0.0]


def test_a_check_pool_checks_in_parallel_and_replaces_only_a_stuck_worker(tmp_path, caplog):
    # bad_rewards.pool_check: a "wait" check returns (1.0) only if another worker runs the "signal" check while it
    # waits, so checks that ran one at a time would score it 0.0 at its timeout. The "hang" check never returns.
    pool = CheckPool(bad_rewards.pool_check, workers=3, warmup=("warm", ""), name="test checker",
                     start_error="bad_rewards must be importable", memory_gib=None, memory_advice="")
    try:
        assert pool.score([("ok", "")] * 4, timeout_s=60.0) == [0.5] * 4  # starts the workers
        workers = {worker._process.pid for worker in pool._workers}
        hung, signal = str(tmp_path / "hung.pid"), str(tmp_path / "signal")
        items = [("hang", hung), ("wait", signal), ("ok", ""), None, ("signal", signal), ("raise", ""), ("ok", "")]
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="lightning_logra.rewards"):
            scores = pool.score(items, timeout_s=5.0)
        elapsed = time.monotonic() - start
        assert scores == [0.0, 1.0, 0.5, 0.0, 1.0, 0.0, 0.5]  # None and a check that raises score 0.0
        assert elapsed < 5.0 + 10  # cut off at its timeout: the hung check alone would take 10 minutes
        assert any("test checker exceeded 5.0 s on ('hang'" in r.getMessage() for r in caplog.records)
        stuck = int(open(hung).read())
        assert stuck in workers and not psutil.pid_exists(stuck)  # killed
        # only that worker was replaced, and the pool goes on
        assert pool.score([("ok", "")] * 3, timeout_s=60.0) == [0.5] * 3
        assert len(workers & {worker._process.pid for worker in pool._workers}) == 2
    finally:
        pool.close()


GIB = 2**30


def _room(pid: int) -> float:
    """The address space, in GiB, process `pid` may still map: its soft RLIMIT_AS less its size now (VmSize)."""
    process = psutil.Process(pid)
    return (process.rlimit(psutil.RLIMIT_AS)[0] - process.memory_info().vms) / GIB


def test_a_check_that_runs_out_of_memory_scores_zero_and_only_its_worker_is_replaced(tmp_path, caplog):
    # bad_rewards.pool_check "hog" allocates 100 MB after 100 MB; 0.5 GiB beyond the worker's start stops it.
    pool = CheckPool(bad_rewards.pool_check, workers=2, warmup=("warm", ""), name="test checker",
                     start_error="bad_rewards must be importable", memory_gib=0.5,
                     memory_advice="raise the test's memory_gib")
    try:
        # "wait" returns only while the other worker runs "signal": both workers have started (and set their limit)
        signal = str(tmp_path / "signal")
        assert pool.score([("wait", signal), ("signal", signal)], timeout_s=60.0) == [1.0, 1.0]
        workers = {worker._process.pid for worker in pool._workers}
        for pid in workers:  # the limit counts from what the worker held once started
            assert 0.25 < _room(pid) <= 0.5
        with caplog.at_level(logging.WARNING, logger="lightning_logra.rewards"):
            scores = pool.score([("hog", ""), ("ok", ""), ("ok", "")], timeout_s=30.0)
        assert scores == [0.0, 0.5, 0.5]
        assert any("test checker ran out of memory (0.5 GiB beyond its start) on ('hog', '')" in r.getMessage()
                   and "raise the test's memory_gib" in r.getMessage() for r in caplog.records)
        assert pool.score([("ok", "")] * 2, timeout_s=60.0) == [0.5] * 2
        assert len(workers & {worker._process.pid for worker in pool._workers}) == 1
    finally:
        pool.close()


def test_math_answer_verifiers_get_their_memory_limit():
    reward = MathAnswer(workers=1, memory_gib=1.5)  # one worker: it has started once the batch is scored
    assert reward(["p"], [r"\boxed{2}"], answer=["2"]) == [1.0]
    (worker,) = rewards.builtin._MATH_POOLS[1, 1.5]._workers
    assert 1.0 < _room(worker._process.pid) <= 1.5
    assert repr(reward) == "MathAnswer(timeout_s=5.0, workers=1, memory_gib=1.5)"
    # the default: 8 GiB, or a quarter of the machine's memory if less
    host_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    assert MathAnswer().memory_gib == rewards.DEFAULT_MEMORY_GIB == pytest.approx(min(8.0, host_gib / 4), abs=0.05)
    for bad in (0, -1.0, math.inf, math.nan, "8", True):
        with pytest.raises(ValueError, match=r"model.reward: MathAnswer's memory_gib must be a positive number of "
                                             r"GiB \(or null: no limit\), got"):
            MathAnswer(memory_gib=bad)


def test_get_reward():
    assert get_reward("exact_match") is exact_match
    assert get_reward("math_answer") is math_answer
    with pytest.raises(ValueError, match=r"model.reward: unknown reward 'f1'; the built-in rewards are "
                                         r"\['environment', 'exact_match', 'math_answer'\]"):
        get_reward("f1")
    # the names the config parser accepts are the built-in rewards
    assert sorted(get_args(RewardName)) == sorted(rewards.BUILTIN)  # one registry: the config's names are its keys


def test_the_string_forms_resolve_as_before():
    assert resolve_reward("math_answer", None) is math_answer
    assert resolve_reward("bad_rewards.sleepy_reward", None) is bad_rewards.sleepy_reward
    built = resolve_reward("lightning_logra.rewards.MathAnswer", None)  # a class named by path: its defaults
    assert isinstance(built, MathAnswer) and built.timeout_s == rewards.DEFAULT_TIMEOUT_S
    with pytest.raises(ValueError, match=r"model.reward: cannot import 'bad_rewards.nope'"):
        resolve_reward("bad_rewards.nope", None)
    with pytest.raises(ValueError, match=r"MathAnswer's timeout_s must be a positive number of seconds, got 0"):
        MathAnswer(timeout_s=0)


def test_a_custom_reward_past_its_deadline_is_stopped_and_the_batch_scores_none(caplog):
    reward = resolve_reward("bad_rewards.sleepy_reward", timeout_s=2.0)
    pid = int(reward(["p"], ["ok"])[0])  # starts the reward process (not counted against the deadline)
    assert pid != os.getpid()
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="lightning_logra.rewards"):
        assert reward(["p", "p"], ["hang", "ok"]) == [None, None]
    assert time.monotonic() - start < 15  # 2 s, then the kill; the hung call would take 10 minutes
    assert any("ran past model.scoring.timeout_s=2 s" in r.getMessage() for r in caplog.records)
    assert not psutil.pid_exists(pid)  # killed
    assert int(reward(["p"], ["ok"])[0]) not in (pid, os.getpid())  # a fresh process takes the next batch


def test_a_reward_past_its_memory_limit_is_replaced_and_the_batch_scores_none(caplog):
    # bad_rewards.hungry_reward allocates 100 MB after 100 MB on a batch with "hog": a MemoryError once its process
    # maps 0.5 GiB more than at its start. That is the batch's end (None, as at the deadline), not the run's.
    reward = resolve_reward("bad_rewards.hungry_reward", timeout_s=30.0, memory_gib=0.5)
    pid = int(reward(["p"], ["ok"])[0])
    with caplog.at_level(logging.WARNING, logger="lightning_logra.rewards"):
        assert reward(["p", "p"], ["hog", "ok"]) == [None, None]
    assert any("'bad_rewards.hungry_reward' ran out of memory on a batch of 2 completions: its process may map "
               "model.scoring.memory_gib=0.5 "
               "GiB" in r.getMessage() and "raise model.scoring.memory_gib" in r.getMessage()
               for r in caplog.records)
    assert not psutil.pid_exists(pid)  # replaced
    assert int(reward(["p"], ["ok"])[0]) not in (pid, os.getpid())  # a fresh process takes the next batch


def test_a_reward_process_may_map_model_reward_memory_gib_beyond_its_start(tiny_arith_model):
    # Beyond, not in all: what the process maps once started (the interpreter and the re-import of the trainer's
    # main module: about 1 GiB under the command line, which imports torch) is not the reward's.
    for memory_gib in (1.5, rewards.DEFAULT_MEMORY_GIB):
        pid = int(resolve_reward("bad_rewards.sleepy_reward", timeout_s=60.0, memory_gib=memory_gib)(["p"], ["ok"])[0])
        assert memory_gib - 0.5 < _room(pid) <= memory_gib
    module = RLVRModule(tiny_arith_model, reward="bad_rewards.sleepy_reward", scoring={"memory_gib": None})
    pid = int(module.rewards[0].fn(["p"], ["ok"])[0])
    assert psutil.Process(pid).rlimit(psutil.RLIMIT_AS)[0] == psutil.RLIM_INFINITY  # null: no limit
    for bad in (0, -2, math.inf, math.nan, "8"):
        with pytest.raises(ValueError, match=r"model.scoring.memory_gib must be a positive number of GiB \(or null: "
                                             r"no limit\), got"):
            RLVRModule(tiny_arith_model, reward="exact_match", scoring={"memory_gib": bad})


def test_the_memory_limit_stays_under_a_hard_limit_of_the_shell():
    # `ulimit -v` sets a hard limit, which the soft limit may not exceed: the limit is capped at it, not refused.
    hard = 64 * GIB
    script = ("import resource; from lightning_logra.base.child import limit_address_space; "
              "limit_address_space(1000.0); print(*resource.getrlimit(resource.RLIMIT_AS))")

    def limit_the_child():
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (hard, hard))

    result = subprocess.run([sys.executable, "-c", script], preexec_fn=limit_the_child, capture_output=True,
                            text=True, check=True)
    assert result.stdout.split() == [str(hard), str(hard)]


def test_built_in_rewards_get_the_deadline_too(tiny_arith_model):
    module = RLVRModule(tiny_arith_model, reward="exact_match", scoring={"timeout_s": 60.0})
    (reward,) = module.rewards
    assert isinstance(reward.fn, TimedReward)
    assert reward.fn(["p", "p"], ["12", "3"], answer=["12", "4"]) == [1.0, 0.0]
    assert RLVRModule(tiny_arith_model, reward="exact_match", scoring={"timeout_s": None}).rewards[0].fn is exact_match


def test_a_class_reward_keeps_its_settings_in_its_reward_process():
    reward = resolve_reward(bad_rewards.StartsWith(prefix="4"), timeout_s=60.0)
    assert reward(["p"] * 3, ["42", "24", "4"]) == [1.0, 0.0, 1.0]
    child = rewards.processes._REWARD_PROCESSES[reward.payload, reward.memory_gib]._process
    assert child.is_alive() and child.pid != os.getpid()  # it was scored there, not here
    # other settings are another reward, with a process of its own
    assert resolve_reward(bad_rewards.StartsWith(prefix="2"), timeout_s=60.0)(["p"], ["24"]) == [1.0]
    assert rewards.processes._REWARD_PROCESSES[reward.payload, reward.memory_gib]._process is child


def test_a_reward_that_does_not_pickle_is_refused_at_set_up_naming_the_key(tiny_arith_model):
    with pytest.raises(ValueError, match=r"model.reward 'bad_rewards.HoldsALock' cannot be sent to its reward "
                                         r"process: it does not pickle \(TypeError: cannot pickle '_thread.lock'"):
        RLVRModule(tiny_arith_model, reward=bad_rewards.HoldsALock(), scoring={"timeout_s": 60.0})
    with pytest.raises(ValueError, match=r"model.reward 'test_rewards.*<lambda>' cannot be sent .*local object"):
        RLVRModule(tiny_arith_model, reward=lambda prompts, completions, **_: [0.0], scoring={"timeout_s": 60.0})
    # in the trainer's process nothing is sent
    assert resolve_reward(bad_rewards.HoldsALock(), timeout_s=None)(["p"], ["c"]) == [0.0]


def test_an_error_in_a_custom_reward_names_it_and_shows_its_traceback():
    # An error that has nothing to do with memory says nothing of the memory limit (every error did)
    with pytest.raises(RuntimeError, match=r"(?s)model.reward 'bad_rewards.broken_reward' raised .*KeyError") as info:
        resolve_reward("bad_rewards.broken_reward", timeout_s=60.0, memory_gib=0.75)(["p"], ["c"], answer=["1"])
    assert "reward_memory_gib" not in str(info.value)
    # An allocation refused under the limit need not be a MemoryError (torch's is a RuntimeError): the limit and its
    # key are named for it
    with pytest.raises(RuntimeError, match=r"(?s)model.reward 'bad_rewards.failed_allocation' raised .*allocate.*"
                                           r"model.scoring.memory_gib=0.75 GiB"):
        resolve_reward("bad_rewards.failed_allocation", timeout_s=60.0, memory_gib=0.75)(["p"], ["c"], answer=["1"])


def test_reward_output_is_checked_and_a_nan_drops_only_its_group():
    with pytest.raises(ValueError, match=r"model.reward 'r' returned 7 rewards for 8 completions \(2 prompts × 4 "
                                         r"samples\): it must return one per completion"):
        reward_tensor([[1.0] * 7], ["r"], [1.0], 2, 4)
    with pytest.raises(ValueError, match=r"model.reward 's' must return a list of 8 numbers"):
        reward_tensor([[1.0] * 8, 1.0], ["r", "s"], [1.0, 1.0], 2, 4)
    rewards, values, missing, dropped = reward_tensor([[1, None, 0, 1, 1, 0, math.nan, 1, 0, 1, 1, 0]], ["r"], [1.0],
                                                      3, 4)
    assert rewards.tolist() == [1, 0, 0, 1, 0, 0, 0, 0, 0, 1, 1, 0]  # None earns 0; the NaN's group is all 0
    assert missing.tolist() == [False, True] + [False] * 4 + [True] + [False] * 5
    assert dropped.tolist() == [False, True, False]
    assert values.shape == (12, 1) and values[1, 0].isnan() and values[4, 0] == 1  # as returned, None as NaN


@pytest.mark.parametrize(("value", "kind"), [("1.0", "str"), (b"1", "bytes"), ([1.0], "list"), (1j, "complex"),
                                           (torch.tensor([1.0]), "Tensor"), (torch.tensor(1j), "Tensor"),
                                           (numpy.array([1.0]), "ndarray")])
def test_a_reward_that_is_not_a_number_names_the_reward_its_type_and_the_completion(value, kind):
    # A string would pass float(); a reward that returns text (or a list, or a tensor of several) is broken.
    with pytest.raises(ValueError, match=rf"model.reward 's' returned a {kind} \(.*\) for completion 2: a reward "
                                         r"must be a number \(int, float, bool, a numpy or 0-d torch scalar\) or None"):
        reward_tensor([[1.0] * 4, [0.0, None, value, 1.0]], ["r", "s"], [1.0, 1.0], 2, 2)


def test_numbers_of_numpy_and_torch_are_rewards():
    # what a reward computed with numpy or torch gives: list(array) and list(tensor) hold numpy scalars and 0-d tensors
    outputs = [[numpy.float32(0.5), numpy.int64(1), numpy.bool_(True), True],
               list(torch.tensor([0.25, 2.0, 1.0, 0.0])), [1, None, 0.5, torch.tensor(True)]]
    rewards, values, missing, dropped = reward_tensor(outputs, ["a", "b", "c"], [1.0, 1.0, 1.0], 2, 2)
    assert values.tolist()[0] == [0.5, 0.25, 1.0] and values[1, 2].isnan() and values[3].tolist() == [1, 0, 1]
    assert rewards.tolist() == [1.75, 3.0, 2.5, 2.0]
    assert not missing.any() and not dropped.any()


def test_weighted_rewards_combine_as_trl_does():
    # Σ w_i·r_i over the functions that rated the completion (None skipped); none rated it: no reward (0.0 here).
    first = [1.0, None, 0.0, None, 0.25, 1.0]
    second = [0.5, 1.0, None, None, -1.0, 0.0]
    rewards, values, missing, dropped = reward_tensor([first, second], ["a", "b"], [2.0, -0.5], 3, 2)
    # 2·1 − 0.5·0.5 = 1.75; −0.5·1; 2·0; no rating; 2·0.25 − 0.5·(−1) = 1.0; 2·1 − 0.5·0 = 2.0
    assert rewards.tolist() == [1.75, -0.5, 0.0, 0.0, 1.0, 2.0]
    assert missing.tolist() == [False, False, False, True, False, False]
    assert not dropped.any()
    assert values[:, 1].isnan().tolist() == [False, False, True, True, False, False]
    # a NaN (not a None) from any one function drops its group, whatever the other functions said
    rewards, _, missing, dropped = reward_tensor([first, [math.nan] + second[1:]], ["a", "b"], [2.0, -0.5], 3, 2)
    assert rewards.tolist() == [0.0, 0.0, 0.0, 0.0, 1.0, 2.0]
    assert dropped.tolist() == [True, False, False]


def test_each_reward_is_summarized_over_the_completions_it_rated():
    values = torch.tensor([[1.0, math.nan, 3.0], [0.0, math.nan, math.nan], [math.nan, math.nan, math.nan],
                           [1.0, math.nan, math.nan]])  # (4 completions, 3 rewards), NaN where a reward said None
    metrics = reward_metrics(values, ["a", "b", "c"], SingleDeviceStrategy(device="cpu"))
    assert set(metrics) == {f"reward/{key}/{stat}" for key in "abc" for stat in ("mean", "std")}
    # a: 1, 0, 1 → mean 2/3, std √((1/9 + 4/9 + 1/9) / 2) = √(1/3); b rated nothing; c rated one completion
    assert float(metrics["reward/a/mean"]) == pytest.approx(2 / 3)
    assert float(metrics["reward/a/std"]) == pytest.approx(math.sqrt(1 / 3))
    assert float(metrics["reward/c/mean"]) == 3.0
    for nan in ("reward/b/mean", "reward/b/std", "reward/c/std"):
        assert math.isnan(float(metrics[nan])), nan


def test_a_list_of_rewards_with_weights_resolves_with_unique_metric_names():
    rewards = resolve_rewards(["exact_match", bad_rewards.StartsWith("4"), bad_rewards.StartsWith("2"),
                               "lightning_logra.rewards.MathAnswer"], [1.0, 0.5, -1, 2.0], timeout_s=None)
    assert [r.key for r in rewards] == ["exact_match", "StartsWith", "StartsWith_2", "MathAnswer"]
    assert [r.weight for r in rewards] == [1.0, 0.5, -1.0, 2.0]
    assert [r.name for r in rewards][::3] == ["exact_match", "lightning_logra.rewards.MathAnswer"]
    assert rewards[0].fn is exact_match and rewards[2].fn(["p"], ["24"]) == [1.0]
    (single,) = resolve_rewards("math_answer", None, timeout_s=60.0)  # one reward, as before: weight 1.0
    assert (single.key, single.weight, isinstance(single.fn, TimedReward)) == ("math_answer", 1.0, True)
    with pytest.raises(ValueError, match=r"model.scoring.weights has 1 weights for the 2 rewards of model.reward: "
                                         r"give one weight per reward"):
        resolve_rewards(["exact_match", "math_answer"], [1.0], timeout_s=None)
    with pytest.raises(ValueError, match=r"model.scoring.weights must be finite numbers, got \[1.0, nan\]"):
        resolve_rewards(["exact_match", "math_answer"], [1.0, math.nan], timeout_s=None)
    with pytest.raises(ValueError, match=r"model.reward is an empty list"):
        resolve_rewards([], None, timeout_s=None)
    with pytest.raises(ValueError, match=r"MathAnswer's workers must be a positive number of processes, got 0"):
        MathAnswer(workers=0)


@pytest.mark.parametrize("chat_template", [False, True], ids=["text", "conversational"])
def test_rewards_get_trl_arguments_completions_as_text_or_messages_and_their_token_ids(tiny_arith_model, tmp_path,
                                                                                     chat_template):
    # TRL's reward signature: prompts, completions (strings, or each a list of one assistant message when a chat
    # template is applied), completion_ids (each completion's tokens, without padding) and the other columns.
    model = tiny_arith_model
    if chat_template:  # the embedded tokenizer has no chat template: one that renders the messages' text as it is
        model = str(tmp_path / "with_template")
        shutil.copytree(tiny_arith_model, model)
        tokenizer = AutoTokenizer.from_pretrained(model)
        tokenizer.chat_template = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
        tokenizer.save_pretrained(model)
    recorder = bad_rewards.RecordCalls()
    module = RLVRModule(model, reward=recorder, chat_template=chat_template, scoring={"timeout_s": None},
                        sampling={"num_generations": 3, "max_new_tokens": 6, "temperature": 1.0})
    module.configure_model()
    batch = {"prompt": ["12+34=", "81+19="], "answer": ["64", "10"]}
    module.score(batch, module.generate(batch, 3, module.sampling, step=-1), 3)
    (call,) = recorder.calls
    assert set(call) == {"prompts", "completions", "completion_ids", "answer"}
    assert call["prompts"] == ["12+34="] * 3 + ["81+19="] * 3 and call["answer"] == ["64"] * 3 + ["10"] * 3
    texts = []
    for completion in call["completions"]:
        if chat_template:
            assert isinstance(completion, list) and len(completion) == 1 and completion[0]["role"] == "assistant"
            completion = completion[0]["content"]
        assert isinstance(completion, str)
        texts.append(completion)
    tokenizer = module.tokenizer
    stops = set(module.stop_token_ids())
    assert len(call["completion_ids"]) == 6
    for ids, text in zip(call["completion_ids"], texts, strict=True):
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
        # no padding: every token is generated, and the completion either ran to the length limit or ends at its stop
        assert 1 <= len(ids) <= 6 and not stops & set(ids[:-1])
        assert len(ids) == 6 or ids[-1] in stops
    assert any(texts), "the random model generated only special tokens: the check of the text compared nothing"


def test_a_reward_that_forks_gets_only_its_own_answers_and_leaves_nothing_behind():
    # The forked copy returns 2.0s into the reward process's loop: answered on the pipe, they would be taken for the
    # next batch's rewards. And a process it leaves behind is stopped with the reward process.
    reward = resolve_reward("bad_rewards.forking_reward", timeout_s=30.0)
    pid = int(reward(["p"], ["ok"])[0])
    assert pid != os.getpid()
    assert reward(["p", "p"], ["linger", "ok"]) == [float(pid)] * 2
    for batch in (["a"], ["b", "c"], ["d", "e", "f"]):
        assert reward(["p"] * len(batch), batch) == [float(pid)] * len(batch)  # each batch its own answers
    group = [process for process in psutil.process_iter() if _group(process) == pid]
    assert len(group) >= 2  # the reward process and what it left behind, in a group of its own
    rewards.processes._REWARD_PROCESSES[reward.payload, reward.memory_gib].close()
    _, alive = psutil.wait_procs(group, timeout=10)
    assert alive == []


def _group(process) -> int | None:
    try:
        return os.getpgid(process.pid)
    except (ProcessLookupError, psutil.NoSuchProcess):
        return None
