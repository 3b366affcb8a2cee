import logging
import threading
import time

import pytest

from lightning_logra.rewards import exact_match, extract_final_answer, get_reward, math_answer


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
    # it). The check must be abandoned at the timeout, score 0.0, and leave a working verifier for the next answer.
    completions = [r"\boxed{10^{10^{10}}}", r"\boxed{2}"]
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="lightning_logra.rewards"):
        scores = _in_thread(math_answer, ["p", "p"], completions, answer=["1", "2"], timeout_s=1.0)
    elapsed = time.monotonic() - start
    assert scores == [0.0, 1.0]
    assert any("exceeded 1.0 s" in record.getMessage() for record in caplog.records)
    # 1 s of timeout plus starting a fresh verifier process; the uncut check would take minutes.
    assert elapsed < 30


def test_get_reward():
    assert get_reward("exact_match") is exact_match
    assert get_reward("math_answer") is math_answer
    with pytest.raises(ValueError, match=r"unknown reward 'f1'; known rewards: \['exact_match', 'math_answer'\]"):
        get_reward("f1")
