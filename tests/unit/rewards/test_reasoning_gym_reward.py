"""ReasoningGymScore: the answer is taken from between its tags (begun in the prompt or in the completion) and only
it reaches the task's scorer; full marks score 1.0, partial credit only when asked for."""

import json
import pickle

import pytest
import reasoning_gym

from lightning_logra.rewards import ReasoningGymScore, extract_stated_answer, extract_tagged_answer
from lightning_logra.rewards import reasoning_gym as module

BEGUN = [{"role": "user", "content": "Calculate 3 + 4.\n\nGive only the final answer, inside <answer></answer> tags."},
         {"role": "assistant", "content": "<answer>"}]


@pytest.mark.parametrize("text, answer", [
    ("<answer>7</answer>", "7"),
    ("<answer> 7 </answer> and more", "7"),
    ("<answer>6</answer> no, <answer>7</answer>", "7"),  # the last one
    ("<answer>7", "7"),  # stopped with the answer open
    ("<answer>7\n</answer>", "7"),
    ("the answer is 7", None),
    ("", None),
])
def test_the_answer_is_the_text_inside_the_last_tag(text, answer):
    assert extract_tagged_answer(text) == answer


def _entry(a: int = 3, b: int = 4) -> dict:
    dataset = reasoning_gym.create_dataset("basic_arithmetic", size=50, seed=0, min_terms=2, max_terms=2,
                                           max_digits=1, operators=["+"], allow_parentheses=False,
                                           allow_negation=False)
    return next(e for e in dataset if e["metadata"]["expression"] == f"{a} + {b}")


def _score(completions, prompt=BEGUN, **settings):
    entry = _entry()
    return ReasoningGymScore(**settings)([prompt] * len(completions), completions,
                                         task=["basic_arithmetic"] * len(completions), entry=[entry] * len(completions))


def test_the_tasks_scorer_gets_the_extracted_answer_only(monkeypatch):
    seen = []

    def scorer(answer, entry):
        seen.append((answer, entry["answer"]))
        return 1.0

    monkeypatch.setattr(module, "_scorer", lambda task: scorer)
    _score(["7</answer>", " 7 </answer> because 3 + 4 = 7", "<answer>8</answer>"])
    # without a tag begun in the prompt only the completion's own tag counts: these have none, and are not scored
    _score(["7</answer>", "no tag at all: 7"], prompt=BEGUN[:1])
    assert seen == [("7", "7"), ("7", "7"), ("8", "7")]


def test_full_marks_score_one_and_partial_credit_is_zero_unless_asked_for():
    completions = ["7</answer>", "7", "17</answer>", "The answer is 7.</answer>", "</answer>", "x"]
    # the default scorer gives an answer that contains the right one partial credit: 1/2 for "17"
    assert _score(completions) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    partial = _score(completions, partial_credit=True)
    assert partial[:2] == [1.0, 1.0] and partial[2] == pytest.approx(0.5) and 0 < partial[3] < 1
    assert partial[4:] == [0.0, 0.0]
    conversational = _score([[{"role": "assistant", "content": "7</answer>"}]])  # TRL's conversational completions
    assert conversational == [1.0]


def test_a_text_prompt_that_ends_with_the_open_tag_begins_the_answer():
    text = "Calculate 3 + 4. Give only the final answer, inside <answer></answer> tags.\n<answer>"
    assert _score(["7</answer>", "7"], prompt=text) == [1.0, 1.0]
    assert _score(["7"], prompt="Calculate 3 + 4. Give the answer inside <answer></answer> tags.") == [0.0]


def test_a_scorer_that_raises_on_the_answer_scores_zero(monkeypatch):
    def scorer(answer, entry):  # reads the entry (its own answer scores), not this answer
        if answer != entry["answer"]:
            raise ValueError("cannot parse")
        return 1.0

    monkeypatch.setattr(module, "_scorer", lambda task: scorer)
    assert _score(["8</answer>"]) == [0.0]


def test_an_entry_given_as_json_text_is_read():
    # A set written to a file with the entry as JSON text: the right answer scored 0.0, in silence.
    entry = json.dumps(_entry())
    reward = ReasoningGymScore()
    assert reward([BEGUN] * 2, ["7</answer>", "8</answer>"], task=["basic_arithmetic"] * 2, entry=[entry] * 2) == [
        1.0, 0.0]


ROW = r"the row of completion 1 \(basic_arithmetic\): "


@pytest.mark.parametrize("task, entry, message", [
    ("basic_arithmetic", None, ROW + r"its entry column must be the item as reasoning-gym made it .*got None"),
    ("basic_arithmetic", "{not json", ROW + r"its entry column is text but not JSON"),
    ("basic_arithmetic", {"question": "Calculate 3 + 4."}, ROW + r".* got a mapping without answer, metadata"),
    # an entry the task's scorer cannot read: it fails even on the entry's own answer
    ("complex_arithmetic", {"question": "q", "answer": "7", "metadata": {}},
     r"the row of completion 1 \(complex_arithmetic\): complex_arithmetic's scorer cannot read its entry"),
])
def test_an_entry_the_scorer_cannot_read_is_an_error_naming_the_row(task, entry, message):
    # Each scored the right answer 0.0, in silence.
    with pytest.raises(ValueError, match=message):
        ReasoningGymScore()([BEGUN] * 2, ["7</answer>"] * 2, task=["basic_arithmetic", task],
                            entry=[_entry(), entry])


def test_an_unknown_task_fails_instead_of_scoring_zero():
    with pytest.raises(Exception, match="not_a_task"):
        ReasoningGymScore()([BEGUN], ["7</answer>"], task=["not_a_task"], entry=[_entry()])


STATED = [{"role": "user", "content": "Calculate 3 + 4.\n\nGive only the final answer."},
          {"role": "assistant", "content": "The answer is"}]


@pytest.mark.parametrize("text, answer", [
    ("The answer is 7.", "7."), ("The answer is 7\nBecause 3 + 4 = 7.", "7"), ("The answer is 6. The answer is 7", "7"),
    ("it is 7", None)])
def test_the_stated_answer_is_the_rest_of_the_line_after_the_last_phrase(text, answer):
    assert extract_stated_answer(text) == answer


def test_the_phrase_form_reads_the_answer_after_the_phrase_the_prompt_began():
    completions = [" 7.", " 7", " 7.\n\nThe sum of 3 and 4 is 7.", " 17.", "The answer is 7", " seven"]
    assert _score(completions, prompt=STATED, answer_format="phrase") == [1.0, 1.0, 1.0, 0.0, 1.0, 0.0]
    # no phrase begun: only a completion that states it counts
    assert _score([" 7.", "The answer is 7."], prompt=STATED[:1], answer_format="phrase") == [0.0, 1.0]


def test_it_pickles_for_its_reward_process_and_refuses_bad_settings():
    reward = pickle.loads(pickle.dumps(ReasoningGymScore(tag="final", partial_credit=True)))
    assert repr(reward) == ("ReasoningGymScore(answer_format='tag', tag='final', phrase='The answer is', "
                            "partial_credit=True)")
    for tag in ("", "<answer>", "a b"):
        with pytest.raises(ValueError, match="ReasoningGymScore's tag must be a name"):
            ReasoningGymScore(tag=tag)
    with pytest.raises(ValueError, match="answer_format must be 'tag' or 'phrase', got 'boxed'"):
        ReasoningGymScore(answer_format="boxed")
    with pytest.raises(ValueError, match="phrase must be some text"):
        ReasoningGymScore(answer_format="phrase", phrase=" ")
