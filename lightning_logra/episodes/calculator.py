"""A calculator tool for real models on arithmetic tasks
(`model.episodes.tools: [lightning_logra.episodes.calculator.calculate]`, as configs/qwen1_5b_tools.yaml gives it): an
expression of numbers, + - * / // % **, unary signs and parentheses, evaluated from its syntax tree (never `eval`),
with bounds that keep a call cheap."""

import ast
import operator

MAX_LENGTH = 256  # characters of an expression
MAX_EXPONENT = 64  # |b| in a ** b
MAX_DIGITS = 256  # an integer result's digits

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is beyond ±{MAX_EXPONENT}")
        result = _BINARY[type(node.op)](left, right)
        if isinstance(result, int) and result.bit_length() > MAX_DIGITS * 3.33:
            raise ValueError(f"the result has more than {MAX_DIGITS} digits")
        if isinstance(result, complex):
            raise ValueError("the result is not a real number")
        return result
    raise ValueError(f"{ast.unparse(node)!r} is not arithmetic: use numbers, + - * / // % ** and parentheses")


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: numbers with + - * / // % ** and parentheses, for example "(12 + 7) * 3 / 4"
    """
    if len(expression) > MAX_LENGTH:
        raise ValueError(f"the expression has {len(expression)} characters; at most {MAX_LENGTH}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ValueError(f"cannot read {expression!r}: {err.msg}") from None
    value = _value(tree.body)
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else format(value, ".12g")
    return str(value)
