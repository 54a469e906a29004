"""The one error type of a setting that is wrong, or that this model, data or device cannot meet, and its kind for
a speedup out of reach."""

from __future__ import annotations

import numbers


class ElasticConfigError(ValueError):
    """A setting of `ElasticTensorSelection` that is invalid, or that fails against the model, data or device.

    Raised by the constructor, and as `fit` starts (patterns that match nothing, a speedup this device cannot
    reach, a profile of another model, a strategy it cannot run under). It is a `ValueError`, and its message
    names the setting, what is allowed and what was given, so a command line can print it without a stack trace.

    Example:
        >>> try:
        ...     raise ElasticConfigError("`speedup` must be a finite number > 1. Found: 0.5")
        ... except ValueError as err:
        ...     print(err)
        `speedup` must be a finite number > 1. Found: 0.5
    """


def one_closure(found: str) -> ElasticConfigError:
    """The refusal of an optimizer that evaluates its closure (the training step) more than once an optimizer step,
    as the fit starts (LBFGS, by type) or at its second evaluation (any other)."""
    return ElasticConfigError(
        "`ElasticTensorSelection` needs an optimizer that runs the training step once per optimizer step (it measures "
        "each update's importance and time around it; LBFGS runs it up to `max_iter` times): use another optimizer, "
        f"or train without the callback. Found: {found}"
    )


class SpeedupOutOfReach(ElasticConfigError):
    """The `ElasticConfigError` of a `speedup` that this model, device and fit cannot reach, raised before the first
    update: `reachable` is the largest one that they can, rounded down as the message gives it, for a caller that
    would rather fit at that speedup than not at all.

    Example:
        >>> err = SpeedupOutOfReach("`speedup` must be at most 2.73 for ... Found: 3.0", reachable=2.73)
        >>> isinstance(err, ElasticConfigError), err.reachable, str(err)[:28]
        (True, 2.73, '`speedup` must be at most 2.')
    """

    def __init__(self, message: str, reachable: float) -> None:
        super().__init__(message)
        self.reachable = reachable

    def __reduce__(self) -> tuple[type[SpeedupOutOfReach], tuple[str, float]]:
        return type(self), (str(self), self.reachable)  # pickled whole: across processes (DDP, a benchmark's runs)


def is_positive_int(value: object) -> bool:
    """Whether `value` is a positive integer (a bool is not, a NumPy integer is).

    Example:
        >>> is_positive_int(3), is_positive_int(0), is_positive_int(True), is_positive_int(2.0)
        (True, False, False, False)
    """
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) > 0
