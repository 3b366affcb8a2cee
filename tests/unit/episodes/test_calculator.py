"""The calculator tool: arithmetic from the syntax tree, bounded, and errors the model can read."""

import pytest
from transformers.utils import get_json_schema

from lightning_logra.episodes.calculator import calculate


@pytest.mark.parametrize("expression, value", [
    ("(12 + 7) * 3 / 4", "14.25"), ("2 ** 10", "1024"), ("-7 // 2", "-4"), ("17 % 5", "2"), ("10 / 4 * 2", "5"),
    ("1 / 3", "0.333333333333"), (" 3.5 + +1 ", "4.5"), ("123 * 456", "56088"),
])
def test_it_evaluates_arithmetic(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("expression, why", [
    ("__import__('os')", "not arithmetic"), ("x + 1", "not arithmetic"), ("'a' * 3", "not arithmetic"),
    ("2 ** 1000", "exponent"), ("(10 ** 60) ** 5", "digits"), ("1 +", "cannot read"), ("1" * 300, "characters"),
    ("(-8) ** 0.5", "not a real number"),
])
def test_it_refuses_what_is_not_bounded_arithmetic(expression, why):
    with pytest.raises(ValueError, match=why):
        calculate(expression)


def test_division_by_zero_is_an_error_the_model_reads():
    with pytest.raises(ZeroDivisionError):
        calculate("1 / (2 - 2)")


def test_its_schema_is_what_the_chat_template_shows():
    schema = get_json_schema(calculate)["function"]
    assert schema["name"] == "calculate" and schema["parameters"]["required"] == ["expression"]
