"""Argument types that check themselves, so that a command-line parser refuses a bad value with the callback's message.

LightningCLI (jsonargparse) checks each argument against its annotation as it parses, and exits with a one-line
error; the constructor's own checks run later, when LightningCLI instantiates the callback, and end in a stack
trace. `Speedup` moves the check of `speedup` into the parse: when jsonargparse is installed (it is optional, never
required), `Speedup` is registered with it, its deserializer raising the constructor's message. Type checkers see
`Speedup` as `float`, so `ElasticTensorSelection(speedup=2.0)` stays well typed.
"""

from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING

from lightning_elastic.errors import ElasticConfigError


def speedup_problem(value: object, name: str = "speedup") -> str | None:
    """The constructor's message for a speedup (the argument `name`) that is not a finite number > 1, or None.

    Example:
        >>> speedup_problem(2.0) is None, speedup_problem(0.5)
        (True, '`speedup` must be a finite number > 1. Found: 0.5')
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 1 < float(value) < math.inf:
        return f"`{name}` must be a finite number > 1. Found: {value!r}"
    return None


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
            number = value
            if isinstance(value, str):
                try:
                    number = float(value)
                except ValueError:
                    number = value
            if (problem := speedup_problem(number)) is not None:
                raise ElasticConfigError(problem)
            return super().__new__(cls, number)


def _register_with_jsonargparse() -> None:
    try:
        from jsonargparse.typing import register_type
    except ImportError:  # LightningCLI is not in use: nothing to register with
        return
    register_type(Speedup, serializer=float, deserializer=Speedup)


_register_with_jsonargparse()
