"""calculator: a tool environment for math problems. The model writes ``<calc>EXPR</calc>`` in a turn; the environment
answers ``<result>VALUE</result>`` for each (in order, one a line), and the model goes on in its next turn. A turn
with no ``<calc>`` is the model's answer: the episode ends and the task's reward scores the model's turns (their
text joined: the math reward reads the last \\boxed{}).

EXPR is arithmetic only, parsed (Python's ast, mode "eval") and evaluated exactly on integers and fractions, never
eval'd: numbers (integers, decimals), + - * / // % ** and parentheses, unary + and -. VALUE is an integer, or a
fraction in lowest terms as a decimal of up to 12 significant digits; any failure is ``<result>error: WHY</result>``
(docs/multi-turn.md, "calculator"). Bounds: MAX_EXPRESSION_CHARS per expression, MAX_NODES parse nodes, exponents
up to MAX_EXPONENT in magnitude, every intermediate value's numerator and denominator below 10**MAX_DIGITS,
MAX_CALLS calculations per turn (more are answered with an error).
"""

from __future__ import annotations

import ast
import operator
import re
from fractions import Fraction
from typing import Any

from megatron_spo.environments.base import EnvContext

CALL = re.compile(r"<calc>(.*?)</calc>", re.S)
MAX_EXPRESSION_CHARS = 200
MAX_NODES = 64
MAX_EXPONENT = 64
MAX_DIGITS = 60
MAX_CALLS = 8
LIMIT = Fraction(10) ** MAX_DIGITS


class CalcError(ValueError):
    """Why an expression has no value (shown to the model as ``error: WHY``)."""


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


def calculate(expression: str) -> Fraction:
    """The exact value of an arithmetic expression, or CalcError (bounded: module docstring)."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalcError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        raise CalcError("not an arithmetic expression") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalcError(f"more than {MAX_NODES} parts")
    return _value(tree.body)


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        if type(node.value) is float and not abs(node.value) < float(LIMIT):
            raise CalcError("number too large")
        return _checked(Fraction(str(node.value)) if type(node.value) is float else Fraction(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _value(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        base, exponent = _value(node.left), _value(node.right)
        if exponent.denominator != 1 or abs(exponent) > MAX_EXPONENT:
            raise CalcError(f"exponents must be integers up to {MAX_EXPONENT}")
        if base == 0 and exponent < 0:
            raise CalcError("division by zero")
        return _checked(base ** int(exponent))  # at most 10**(MAX_DIGITS * MAX_EXPONENT) before the check
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if right == 0 and isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)):
            raise CalcError("division by zero")
        return _checked(Fraction(_BINARY[type(node.op)](left, right)))
    raise CalcError("only numbers, + - * / // % ** and parentheses are allowed")


def _checked(value: Fraction) -> Fraction:
    if abs(value.numerator) >= LIMIT or value.denominator >= LIMIT:
        raise CalcError("result too large")
    return value


def format_value(value: Fraction) -> str:
    """An integer as is; a fraction as a decimal of up to 12 significant digits."""
    if value.denominator == 1:
        return str(value.numerator)
    return format(value.numerator / value.denominator, ".12g")


def answer(expression: str) -> str:
    """``<result>VALUE</result>`` or ``<result>error: WHY</result>`` of one expression."""
    try:
        return f"<result>{format_value(calculate(expression))}</result>"
    except CalcError as err:
        return f"<result>error: {err}</result>"


class Calculator:
    """One conversation on one math problem; the episode's reward is the task's (EnvContext.reward)."""

    needs_sandbox = False

    def __init__(self, ctx: EnvContext):
        self.ctx, self.problem, self.turns = ctx, None, []

    async def reset(self, problem: Any) -> None:
        self.problem, self.turns = problem, []
        return None

    async def step(self, model_turn: str) -> tuple[str | None, bool, float | None]:
        self.turns.append(model_turn)
        calls = CALL.findall(model_turn)
        if not calls or len(self.turns) >= self.ctx.config.max_turns:
            reward = None if self.ctx.reward is None else await self.ctx.reward(self.problem, "".join(self.turns))
            return None, True, reward
        results = [answer(e) for e in calls[:MAX_CALLS]]
        if len(calls) > MAX_CALLS:
            results.append(f"<result>error: at most {MAX_CALLS} calculations per turn ({len(calls) - MAX_CALLS} "
                           "more not done)</result>")
        return "\n".join(results), False, None
