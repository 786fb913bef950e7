"""The `calculator` tool: exact arithmetic by walking Python's `ast`, never `eval`.

Only numbers, + - * / // % **, unary signs, parentheses, a few math functions and pi/e are
understood; anything else (names, attributes, other calls) is refused with a `ToolError`.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable

from .tool import ToolError, tool

_MAX_EXPONENT = 1000
_MAX_BITS = 10_000  # ~3000 decimal digits: far below int->str's 4300-digit limit
_MAX_LENGTH = 2000  # deeper nesting makes ast.parse itself recurse too far
# Operators and calls within one another, at most: far more than a model writes, and few enough
# frames that the walk below never meets Python's recursion limit. Counted here rather than
# left to RecursionError, whose limit depends on who set it last (torch's compiler raises it)
_MAX_DEPTH = 200
_TOO_DEEP = "calculator: expression is nested too deeply; split it up"

_BINARY: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS: dict[str, Callable[..., float]] = {
    "sqrt": math.sqrt,
    "sin": math.sin,
    "cos": math.cos,
    "tan": math.tan,
    "log": math.log,
    "log10": math.log10,
    "exp": math.exp,
    "abs": abs,
    "round": round,
    "floor": math.floor,
    "ceil": math.ceil,
}
_CONSTANTS = {"pi": math.pi, "e": math.e}


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly: + - * / // % ** and parentheses, the functions
    sqrt, sin, cos, tan, log, log10, exp, abs, round, floor, ceil, and the constants pi and e.

    Args:
        expression: The expression to evaluate, e.g. "17*23" or "sqrt(2) / 2".
    """
    value = evaluate(expression)
    # The expression is echoed so a small model can copy "17*23 = 391" into its answer whole;
    # ints exactly, floats with the shortest repr that round-trips.
    return f"{expression.strip()} = {value!r}"


def evaluate(expression: str) -> int | float:
    """The value of `expression`, or a ToolError that says what is not allowed."""
    if len(expression) > _MAX_LENGTH:
        raise ToolError(f"calculator: expression is longer than {_MAX_LENGTH} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ToolError(f"calculator: cannot parse {expression!r}: {e.msg}") from None
    try:
        return _eval(tree.body)
    except RecursionError:  # a caller already deep in its own stack
        raise ToolError(_TOO_DEEP) from None


def _eval(node: ast.AST, depth: int = 0) -> int | float:
    """The value of `node`, `depth` operators and calls inside the expression ("1+1+...+1" a
    thousand times nests a thousand BinOps)."""
    if depth > _MAX_DEPTH:
        raise ToolError(_TOO_DEEP)
    if isinstance(node, ast.Constant):
        if type(node.value) not in (int, float):  # bool is an int subclass, so compare types
            raise ToolError(f"calculator: {node.value!r} is not a number")
        return node.value
    if isinstance(node, ast.Name):
        if node.id not in _CONSTANTS:
            known = ", ".join([*_CONSTANTS, *_FUNCTIONS])
            raise ToolError(f"calculator: unknown name {node.id!r} (known: {known})")
        return _CONSTANTS[node.id]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand, depth + 1))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _binary(node.op, _eval(node.left, depth + 1), _eval(node.right, depth + 1))
    if isinstance(node, ast.Call):
        return _call(node, depth)
    if isinstance(node, ast.Attribute):
        raise ToolError(f"calculator: attribute access ('.{node.attr}') is not allowed")
    raise ToolError(f"calculator: {type(node).__name__} expressions are not allowed")


def _binary(op: ast.operator, left: float, right: float) -> int | float:
    if isinstance(op, ast.Pow):
        _check_power(left, right)
    try:
        result = _BINARY[type(op)](left, right)
    except ZeroDivisionError:
        raise ToolError("calculator: division by zero") from None
    except OverflowError:
        raise ToolError("calculator: result too large") from None
    if isinstance(result, complex):  # (-8) ** 0.5
        raise ToolError("calculator: result is a complex number")
    if isinstance(result, int) and result.bit_length() > _MAX_BITS:
        raise ToolError(f"calculator: result too large (more than {_MAX_BITS} bits)")
    return result


def _check_power(base: float, exponent: float) -> None:
    """Refuse a power before computing it: 9**9**9 would take minutes and gigabytes."""
    if abs(exponent) > _MAX_EXPONENT:
        raise ToolError(f"calculator: exponent {exponent} is larger than {_MAX_EXPONENT}")
    exact = isinstance(base, int) and isinstance(exponent, int) and exponent > 0
    if exact and (abs(base).bit_length() - 1) * exponent > _MAX_BITS:
        raise ToolError(f"calculator: result too large (more than {_MAX_BITS} bits)")


def _call(node: ast.Call, depth: int) -> int | float:
    if not isinstance(node.func, ast.Name):
        return _eval(node.func, depth)  # refuses it: an attribute (os.system) or a call's result
    if node.func.id not in _FUNCTIONS:
        known = ", ".join(_FUNCTIONS)
        raise ToolError(f"calculator: function {node.func.id!r} is not allowed (allowed: {known})")
    name = node.func.id
    if node.keywords:
        raise ToolError(f"calculator: {name}() takes no keyword arguments")
    args = [_eval(arg, depth + 1) for arg in node.args]
    try:
        return _FUNCTIONS[name](*args)
    except TypeError as e:
        raise ToolError(f"calculator: {name}(): {e}") from None
    except ValueError:
        raise ToolError(
            f"calculator: {name} is undefined for {', '.join(map(repr, args))}"
        ) from None
    except OverflowError:
        raise ToolError(f"calculator: {name}(...) result too large") from None
