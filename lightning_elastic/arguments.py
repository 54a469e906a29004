"""Argument types that check themselves, so that a command-line parser refuses a bad value with the callback's message.

LightningCLI (jsonargparse) checks each argument against its annotation as it parses, and exits with a one-line
error; the constructor's own checks run later, when LightningCLI instantiates the callback, and end in a stack
trace. `Speedup` and `PositiveInt` move the checks of `speedup`, `interval`, `probe_steps` and `resolution` into the
parse: when jsonargparse is installed (it is optional, never required), both are registered with it, their
deserializers raising the constructor's message. Type checkers see them as `float` and `int`, so
`ElasticTensorSelection(speedup=2.0, interval=2)` stays well typed. (The other arguments are checked by their
annotations already: `Literal` choices, `bool`.)
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import TYPE_CHECKING

from lightning_elastic.errors import ElasticConfigError, is_positive_int


def speedup_problem(value: object, name: str = "speedup") -> str | None:
    """The constructor's message for a speedup (the argument `name`) that is not a finite number > 1, or None.

    Example:
        >>> speedup_problem(2.0) is None, speedup_problem(0.5)
        (True, '`speedup` must be a finite number > 1. Found: 0.5')
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 1 < float(value) < math.inf:
        return f"`{name}` must be a finite number > 1. Found: {value!r}"
    return None


def _parsed(value: object, parse: Callable[[str], object]) -> object:
    """A command line's text read as a number by `parse`; anything else (or text it cannot read) as it is."""
    if isinstance(value, str):
        try:
            return parse(value)
        except ValueError:
            return value
    return value


if TYPE_CHECKING:
    Speedup = float
else:

    class Speedup(float):
        """A `speedup` as a parser reads it: a finite number > 1, from a number or its text on a command line.

        Example:
            >>> Speedup("2.5"), Speedup(3)
            (2.5, 3.0)
        """

        def __new__(cls, value: object) -> Speedup:
            number = _parsed(value, float)
            if (problem := speedup_problem(number)) is not None:
                raise ElasticConfigError(problem)
            return super().__new__(cls, number)


if TYPE_CHECKING:
    PositiveInt = int
else:

    class PositiveInt(int):
        """A count as a parser reads it (`interval`, `probe_steps`, `resolution`): an int > 0, or its text.

        The parser names the argument (``Parser key "interval"``), so the message says only what is wrong.

        Example:
            >>> PositiveInt("3"), PositiveInt(2)
            (3, 2)
            >>> PositiveInt("0")
            Traceback (most recent call last):
            ...
            lightning_elastic.errors.ElasticConfigError: must be a positive int. Found: 0
        """

        def __new__(cls, value: object) -> PositiveInt:
            number = _parsed(value, int)
            if not is_positive_int(number):
                raise ElasticConfigError(f"must be a positive int. Found: {number!r}")
            return super().__new__(cls, number)


def _register_with_jsonargparse() -> None:
    try:
        from jsonargparse.typing import register_type
    except ImportError:  # LightningCLI is not in use: nothing to register with
        return
    register_type(Speedup, serializer=float, deserializer=Speedup)
    register_type(PositiveInt, serializer=int, deserializer=PositiveInt)


_register_with_jsonargparse()
