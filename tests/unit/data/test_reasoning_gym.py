"""reasoning-gym's tasks as a data module: the mix's shares, items that are a function of the seed, a held-out set
apart from the training questions, the prompts' forms and columns, and bad tasks or settings refused by key."""

import logging
import signal
import time

import pytest
import reasoning_gym

from lightning_logra.data import reasoning_gym as reasoning_gym_data
from lightning_logra.data.reasoning_gym import (
    DEFAULT_INSTRUCTION,
    DEFAULT_PREFIX,
    ReasoningGymDataModule,
    ReasoningTask,
    shares,
)

ARITHMETIC = {"name": "basic_arithmetic", "settings": {"min_terms": 2, "max_terms": 2, "max_digits": 2,
                                                       "allow_parentheses": False, "allow_negation": False}}
MIX = [ARITHMETIC, {"name": "spell_backward", "weight": 3.0, "settings": {"min_word_len": 3, "max_word_len": 6}}]


def _module(**settings) -> ReasoningGymDataModule:
    return ReasoningGymDataModule(**{"tasks": MIX, "size": 40, "eval_size": 10, **settings})


def _rows(dataset) -> list[dict]:
    return [dataset[i] for i in range(len(dataset))]


def test_items_are_a_function_of_the_seed_and_the_mix_follows_the_weights():
    first, again, other = _module(seed=3), _module(seed=3), _module(seed=4)
    rows = _rows(first.make_train_set())
    assert rows == _rows(again.make_train_set())
    assert rows != _rows(other.make_train_set())
    tasks = [row["task"] for row in rows]
    assert (tasks.count("basic_arithmetic"), tasks.count("spell_backward")) == (10, 30)  # weights 1 : 3 of 40
    assert _rows(first.make_eval_set("validate")) == _rows(again.make_eval_set("test"))
    assert first.task_names() == ["basic_arithmetic", "spell_backward"]


@pytest.mark.parametrize("weights, size, expected", [
    ([1, 1, 1], 10, [4, 3, 3]), ([2, 1], 3, [2, 1]), ([0.1, 0.3, 0.6], 7, [1, 2, 4]), ([1], 5, [5])])
def test_shares_add_up_to_the_size_and_stay_within_one_of_the_exact_share(weights, size, expected):
    tasks = [ReasoningTask(f"t{i}", weight) for i, weight in enumerate(weights)]
    counts = shares(tasks, size)
    assert counts == expected and sum(counts) == size
    for count, weight in zip(counts, weights):
        assert abs(count - size * weight / sum(weights)) < 1


def test_the_evaluation_set_is_held_out_from_the_training_questions():
    # 2-term additions of 1-digit numbers: 200 distinct questions, so 150 training items take most of them
    small = {"name": "basic_arithmetic", "settings": {**ARITHMETIC["settings"], "max_digits": 1}}
    module = ReasoningGymDataModule([small], size=150, eval_size=40, seed=0)
    train = {row["prompt"][-2]["content"] for row in _rows(module.make_train_set())}
    held_out = _rows(module.make_eval_set("validate"))
    assert 0 < len(held_out) < 40  # those that repeat a training question are left out
    assert not train & {row["prompt"][-2]["content"] for row in held_out}
    additions = {"name": "basic_arithmetic", "settings": {**small["settings"], "operators": ["+"]}}  # 100 questions
    everything = ReasoningGymDataModule([additions], size=2000, eval_size=10, seed=0)
    with pytest.raises(ValueError, match="every evaluation item of basic_arithmetic is also a training question"):
        everything.make_eval_set("validate")


def test_a_row_is_a_chat_with_the_instruction_and_the_answer_begun_and_the_columns_the_reward_reads():
    row = _module().make_train_set()[0]
    user, assistant = row["prompt"]
    entry = row["entry"]
    assert user == {"role": "user", "content": f"{entry['question'].rstrip()}\n\n{DEFAULT_INSTRUCTION}"}
    assert assistant == {"role": "assistant", "content": DEFAULT_PREFIX}
    assert row["task"] == entry["metadata"]["source_dataset"] == "basic_arithmetic"
    assert row["answer"] == str(entry["answer"])


def test_a_system_prompt_no_prefix_and_plain_text():
    chat = _module(system_prompt="Be brief.", answer_prefix=None).make_train_set()[0]["prompt"]
    assert [m["role"] for m in chat] == ["system", "user"] and chat[0]["content"] == "Be brief."
    text = _module(chat_template=False, instruction="Answer: <answer>x</answer>").make_train_set()[0]
    assert isinstance(text["prompt"], str)
    assert text["prompt"].endswith(f"{text['entry']['question'].rstrip()}\n\nAnswer: <answer>x</answer>\n<answer>")


@pytest.mark.parametrize("tasks, message", [
    ([], "data.tasks is empty"),
    ([{"name": "basic_arithmetik"}], r"data.tasks\[0\].name: 'basic_arithmetik' is not a reasoning-gym task "
                                     r"\(did you mean basic_arithmetic or "),
    ([ARITHMETIC, ARITHMETIC], r"data.tasks\[1\].name: 'basic_arithmetic' is in data.tasks twice"),
    ([{"name": "gcd", "weight": 0}], r"data.tasks\[0\].weight must be a positive number"),
    ([{"name": "gcd", "weight": float("nan")}], r"data.tasks\[0\].weight must be a positive number"),
    ([{"name": "gcd", "settings": {"max_digits": 3}}], r"data.tasks\[0\].settings.max_digits: gcd has no such "
                                                        r"setting; its settings are min_numbers, max_numbers"),
    ([{"name": "gcd", "settings": {"seed": 3}}], r"data.tasks\[0\].settings.seed: the data module sets it"),
    ([{"name": "gcd", "settings": {"min_value": 50, "max_value": 10}}], r"data.tasks\[0\].settings: gcd refuses"),
])
def test_bad_tasks_and_settings_are_refused_naming_the_key(tasks, message):
    with pytest.raises(ValueError, match=message):
        ReasoningGymDataModule(tasks)


@pytest.mark.parametrize("settings, message", [
    ({"size": 0}, "data.size must be a positive number of items"),
    ({"size": 1}, r"data.size=1 shared by weight gives data.tasks\[0\] \(basic_arithmetic, weight 1\) no items"),
    ({"eval_size": -1}, "data.eval_size must be a positive number of items per task"),
    ({"eval_seed": 1.5}, "data.eval_seed must be a whole number"),
])
def test_bad_sizes_are_refused_naming_the_key(settings, message):
    with pytest.raises(ValueError, match=message):
        _module(**settings)


def test_a_task_whose_weight_gives_it_no_items_is_refused():
    tasks = [{"name": "gcd", "weight": 100}, {"name": "lcm"}, {"name": "chain_sum"}]
    with pytest.raises(ValueError, match=r"data.tasks\[1\] \(lcm, weight 1\) no items: raise data.size"):
        ReasoningGymDataModule(tasks, size=3)
    assert ReasoningGymDataModule(tasks, size=102).size == 102  # one item each at least


@pytest.mark.parametrize("settings, message", [
    # 2.5 digits passed every check and failed at the first item ("non-integer stop for randrange()")
    ({"max_digits": 2.5}, r"data.tasks\[0\].settings.max_digits: basic_arithmetic takes a whole number, got 2.5"),
    ({"allow_negation": "no"}, r"data.tasks\[0\].settings.allow_negation: basic_arithmetic takes true or false"),
    ({"format_style": "fancy"}, r"data.tasks\[0\].settings.format_style: basic_arithmetic takes one of 'simple', "
                                r"'natural', got 'fancy'"),
    ({"operators": "+"}, r"data.tasks\[0\].settings.operators: basic_arithmetic takes a list of text, got '\+'"),
])
def test_a_setting_of_the_wrong_type_is_refused_naming_the_key(settings, message):
    with pytest.raises(ValueError, match=message):
        ReasoningGymDataModule([{"name": "basic_arithmetic", "settings": settings}])


def test_settings_of_the_annotated_types_pass_and_a_wrong_annotation_is_not_held_against_them():
    settings = {"max_digits": 2, "operators": ["+"], "format_style": "natural", "allow_negation": False}
    assert ReasoningGymDataModule([{"name": "basic_arithmetic", "settings": settings}], size=4).size == 4
    # `variables: tuple[str] = ("x", "y", "z")`: a tuple of one by the letter; its own default does not fit it
    task = {"name": "polynomial_multiplication", "settings": {"variables": ["x", "y"]}}
    assert ReasoningGymDataModule([task], size=4).tasks[0].settings == {"variables": ["x", "y"]}


def test_settings_that_make_no_item_are_refused_when_the_module_is_built_naming_the_key(monkeypatch):
    # Words of 60 to 70 letters pass the generator's own check; the first item then failed deep inside it
    # ("IndexError: Cannot choose from an empty sequence"), without naming a key.
    spelling = {"name": "spell_backward", "settings": {"min_word_len": 60, "max_word_len": 70}}
    with pytest.raises(ValueError, match=r"data.tasks\[1\].settings.min_word_len: spell_backward cannot make item 0 "
                                         r"with \{'min_word_len': 60, 'max_word_len': 70\}: IndexError"):
        ReasoningGymDataModule([ARITHMETIC, spelling])
    # 5000-digit operands: item 3's answer is too long to write as text, item 1 never comes (a divisor search up to
    # the square root of a 5000-digit number).
    added = {"name": "basic_arithmetic", "settings": {"max_digits": 5000, "operators": ["+"]}}
    with pytest.raises(ValueError, match=r"data.tasks\[0\].settings.max_digits: basic_arithmetic cannot make item 3 "
                                         r"with .*ValueError: Exceeds the limit \(4300 digits\)"):
        ReasoningGymDataModule([added])
    monkeypatch.setattr(reasoning_gym_data, "DRAW_TIMEOUT_S", 0.5)
    huge = {"name": "basic_arithmetic", "settings": {"max_digits": 5000, "min_terms": 2}}
    with pytest.raises(ValueError, match=r"data.tasks\[0\].settings.max_digits: basic_arithmetic took over 0.5 s for "
                                         r"item 1 with \{'max_digits': 5000, 'min_terms': 2\}"):
        ReasoningGymDataModule([huge])
    # An item past the first ones fails in the same words when the sets are made.
    monkeypatch.setattr(reasoning_gym_data, "_FIRST_ITEMS", 1)
    module = ReasoningGymDataModule([{"name": "gcd"}, huge], size=40)
    with pytest.raises(ValueError, match=r"data.tasks\[1\].settings.max_digits: basic_arithmetic took over 0.5 s for "
                                         r"item 1"):
        module.make_train_set()


class _Swallowing:
    """A generator whose loop swallows what interrupts it, as quantum_lock's search does with a bare `except:` around
    its arithmetic: the first alarm is taken for one of its own errors, then it runs on (for ever in the real one;
    3 s here, so that the test ends even where the limit does not hold)."""

    def __init__(self, caught: type[BaseException]) -> None:
        self.caught = caught

    def __getitem__(self, index: int) -> dict:
        try:
            while True:
                time.sleep(0.01)
        except self.caught:
            pass
        runs_on = time.monotonic() + 3.0
        while time.monotonic() < runs_on:
            time.sleep(0.01)
        return {"question": "q", "answer": "a", "metadata": {}}


@pytest.mark.parametrize("caught", [Exception, BaseException])
def test_an_item_is_bounded_in_time_even_where_the_generator_swallows_the_alarm(monkeypatch, caught):
    # An `except Exception` took the limit's exception for a generator error, and the alarm came once: the item ran
    # unbounded. Now it is no Exception, and it comes again after the code inside swallowed it.
    monkeypatch.setattr(reasoning_gym, "create_dataset", lambda name, size, seed, **settings: _Swallowing(caught))
    monkeypatch.setattr(reasoning_gym_data, "DRAW_TIMEOUT_S", 0.2)
    monkeypatch.setattr(reasoning_gym_data, "_REARM_S", 0.1)
    handler = signal.getsignal(signal.SIGALRM)
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"data.tasks\[0\].settings: gcd took over 0.2 s for item 0"):
        reasoning_gym_data.generate(ReasoningTask("gcd"), 1, seed=0, key="data.tasks[0]")
    assert time.monotonic() - started < 2.0
    # The timer is cancelled and the handler put back: no alarm reaches the code that follows.
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0) and signal.getsignal(signal.SIGALRM) is handler


def test_weights_that_overflow_are_refused_and_large_ones_share_exactly():
    # Two weights of 1e308 add up to inf: the shares were NaN ("cannot convert float NaN to integer").
    with pytest.raises(ValueError, match=r"data.tasks\[\*\].weight: the weights add up to inf .*relative"):
        ReasoningGymDataModule([{"name": "gcd", "weight": 1e308}, {"name": "lcm", "weight": 1e308}])
    with pytest.raises(ValueError, match=r"data.tasks\[0\].weight must be a positive number.*got inf"):
        ReasoningGymDataModule([{"name": "gcd", "weight": float("inf")}])
    # size · weight overflowed before the division by the total
    assert shares([ReasoningTask("a", 1e308), ReasoningTask("b", 3e307)], 13) == [10, 3]


@pytest.mark.parametrize("task, message", [
    ({"name": "gcd", "wieght": 2}, r"data.tasks\[0\]: unknown key 'wieght'; a task has name, weight and settings"),
    ({"weight": 2}, r"data.tasks\[0\]: no name: give the reasoning-gym task's name"),
    ({"name": "gcd", "settings": [1]}, r"data.tasks\[0\].settings must be a mapping of the generator's settings"),
    ("gcd", r"data.tasks\[0\] must be a mapping such as \{name: gcd, weight: 1, settings: \{\}\}, got 'gcd'"),
])
def test_a_task_that_is_not_name_weight_and_settings_is_refused_naming_it(task, message):
    with pytest.raises(ValueError, match=message):
        ReasoningGymDataModule([task])


def test_a_tasks_override_replaces_the_mix_without_keeping_the_config_files_settings(run_cli, tmp_path):
    # jsonargparse merged a list of dataclasses element by element: `--data.init_args.tasks` naming the config file's
    # tasks again (or others in their places) kept each one's old settings.
    config = tmp_path / "data.yaml"
    config.write_text("""data:
  class_path: lightning_logra.data.reasoning_gym.ReasoningGymDataModule
  init_args:
    tasks:
      - {name: basic_arithmetic, weight: 3, settings: {max_digits: 2, min_terms: 2, max_terms: 2}}
      - {name: gcd, settings: {min_value: 2, max_value: 20}}
    size: 20
    eval_size: 4
""")
    cli = run_cli("tiny_arith", "--config", str(config), "--data.init_args.tasks",
                  "[{name: basic_arithmetic}, {name: chain_sum, settings: {min_terms: 3}}]", fast=False, run=False)
    assert cli.datamodule.tasks == [ReasoningTask("basic_arithmetic"),
                                    ReasoningTask("chain_sum", 1.0, {"min_terms": 3})]


def test_a_resume_with_other_data_settings_says_what_changed(caplog):
    saved = _module(seed=3).state_dict()
    other_mix = [ARITHMETIC, {**MIX[1], "weight": 1.0}]
    with caplog.at_level(logging.WARNING, logger="lightning_logra.data.module"):
        _module(seed=3).load_state_dict(saved)
        assert caplog.records == []  # the same settings: nothing to say
        _module(seed=4, size=48, tasks=other_mix).load_state_dict(saved)
    said = [record.getMessage() for record in caplog.records]
    assert len(said) == 3 and said[0] == "data.seed: the checkpoint was made with 3, this run uses 4"
    assert said[1].startswith("data.tasks: the checkpoint was made with [") and "'weight': 3.0" in said[1]
    assert said[2] == "data.size: the checkpoint was made with 40, this run uses 48"
