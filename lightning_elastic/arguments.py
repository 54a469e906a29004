"""The callback's arguments checked: all at once by its constructor (`Settings.checked`, which says every
`constructor_problems` at once and is the callback's record of them), and the numbers again by types that check
themselves, so that a command-line parser refuses a bad value with the constructor's message.

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
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

from numpy import bool_ as np_bool

from lightning_elastic.errors import ElasticConfigError, is_positive_int
from lightning_elastic.freezing import BN_POLICIES, BnPolicy
from lightning_elastic.profiling import TimeModel, TimingProfile
from lightning_elastic.schedule import IntervalUnit
from lightning_elastic.units import UNIT_KINDS, UnitKind

# The selection's dynamic program keeps a byte per tensor and grid unit (`selector.select`): 100,000 units of a step's
# budget are a microsecond of a 100 ms step, below any clock's noise; 10**12 asked for 7 TiB at the first selection.
MAX_RESOLUTION = 100_000

TIME_MODELS: tuple[str, ...] = get_args(TimeModel)
INTERVAL_UNITS: tuple[str, ...] = get_args(IntervalUnit)


def speedup_problem(value: object, name: str = "speedup") -> str | None:
    """The constructor's message for a speedup (the argument `name`) that is not a finite number > 1, or None.

    Example:
        >>> speedup_problem(2.0) is None, speedup_problem(0.5)
        (True, '`speedup` must be a finite number > 1. Found: 0.5')
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 1 < float(value) < math.inf:
        return f"`{name}` must be a finite number > 1. Found: {value!r}"
    return None


def constructor_problems(
    *,
    speedup: object,
    interval: object,
    interval_unit: object,
    probe_steps: object,
    time_model: object,
    train_always: object,
    train_never: object,
    bn_policy: object,
    resolution: object,
    cache_dir: object,
    profile: object,
    calibrate: object,
    log_images: object,
    clock: object,
    units: object,
) -> list[str]:
    """What is wrong with each argument of `ElasticTensorSelection` (see its docstring), one message each; [] if none.

    Example:
        >>> constructor_problems(
        ...     speedup=2.0, interval=0, interval_unit="epoch", probe_steps="auto", time_model="measured",
        ...     train_always=(), train_never=(), bn_policy="update", resolution=1000, cache_dir=None, profile=None,
        ...     calibrate=True, log_images=True, clock=float, units="layer",
        ... )
        ['`interval` must be a positive int. Found: 0']
    """
    problems = []
    if (problem := speedup_problem(speedup)) is not None:
        problems.append(problem)
    if not is_positive_int(interval):
        problems.append(f"`interval` must be a positive int. Found: {interval!r}")
    if interval_unit not in INTERVAL_UNITS:
        problems.append(f"`interval_unit` must be one of {INTERVAL_UNITS}. Found: {interval_unit!r}")
    if probe_steps != "auto" and not is_positive_int(probe_steps):
        problems.append(f"`probe_steps` must be a positive int or 'auto'. Found: {probe_steps!r}")
    if time_model not in TIME_MODELS:
        problems.append(f"`time_model` must be one of {TIME_MODELS}. Found: {time_model!r}")
    for name, patterns in (("train_always", train_always), ("train_never", train_never)):
        if (
            isinstance(patterns, str)
            or not isinstance(patterns, Iterable)
            or not all(isinstance(p, str) and p for p in patterns)
        ):
            problems.append(f"`{name}` must be a list of non-empty name patterns. Found: {patterns!r}")
    if bn_policy not in BN_POLICIES:
        problems.append(f"`bn_policy` must be one of {BN_POLICIES}. Found: {bn_policy!r}")
    if not is_positive_int(resolution) or int(resolution) > MAX_RESOLUTION:  # type: ignore[call-overload]
        problems.append(f"`resolution` must be a positive int of at most {MAX_RESOLUTION}. Found: {resolution!r}")
    if cache_dir is not None and cache_dir is not False and (  # not `in (None, False)`: 0 == False
        not isinstance(cache_dir, (str, os.PathLike)) or not os.fspath(cache_dir)
    ):
        problems.append(f"`cache_dir` must be a directory path, None (the user cache) or False. Found: {cache_dir!r}")
    if profile is not None and not isinstance(profile, (TimingProfile, str, os.PathLike)):
        problems.append(f"`profile` must be a TimingProfile, a path to one saved as JSON, or None. Found: {profile!r}")
    elif isinstance(profile, (str, os.PathLike)) and not (os.fspath(profile) and os.path.isfile(profile)):
        missing = "not a file" if os.fspath(profile) and os.path.isdir(profile) else "no such file"
        problems.append(f"`profile` must be the path of a saved timing profile. Found: {profile!r} ({missing})")
    for name, flag in (("calibrate", calibrate), ("log_images", log_images)):
        if not isinstance(flag, (bool, np_bool)):
            problems.append(f"`{name}` must be True or False. Found: {flag!r}")
    if not callable(clock):
        problems.append(f"`clock` must be a callable returning seconds. Found: {clock!r}")
    if units not in UNIT_KINDS:
        problems.append(f"`units` must be one of {UNIT_KINDS}. Found: {units!r}")
    return problems


@dataclass(frozen=True)
class Settings:
    """The callback's arguments once checked (each is described in `ElasticTensorSelection`'s docstring, whose
    signature holds their defaults).

    Example:
        >>> arguments = dict(
        ...     speedup=3, interval=2, interval_unit="epoch", probe_steps="auto", time_model="auto", train_always=[],
        ...     train_never=(), bn_policy="update", resolution=1000, cache_dir=None, profile=None, calibrate=True,
        ...     log_images=True, clock=float, units="layer",
        ... )
        >>> settings = Settings.checked(**arguments)
        >>> settings.speedup, settings.interval, settings.train_always
        (3.0, 2, ())
        >>> Settings.checked(**{**arguments, "speedup": 0.5, "resolution": 0})
        Traceback (most recent call last):
        ...
        lightning_elastic.errors.ElasticConfigError: `speedup` must be a finite number > 1. Found: 0.5; \
`resolution` must be a positive int of at most 100000. Found: 0
    """

    speedup: float
    interval: int
    interval_unit: IntervalUnit
    probe_steps: int | Literal["auto"]
    time_model: TimeModel
    train_always: tuple[str, ...]
    train_never: tuple[str, ...]
    bn_policy: BnPolicy
    resolution: int
    cache_dir: str | os.PathLike[str] | Literal[False] | None
    profile: TimingProfile | str | os.PathLike[str] | None
    calibrate: bool
    log_images: bool
    clock: Callable[[], float]
    units: UnitKind

    @classmethod
    def checked(cls, **arguments: Any) -> Settings:
        """The settings of these arguments (every one of them), every problem said at once.

        Raises:
            ElasticConfigError: naming each argument that is not allowed, what is allowed and what was given.
        """
        for name in ("train_always", "train_never"):  # an iterator is read once, here: not used up by the checks
            patterns = arguments[name]
            if isinstance(patterns, Iterator):  # a list is shown as given in a refusal
                arguments = {**arguments, name: tuple(patterns)}
        if problems := constructor_problems(**arguments):
            raise ElasticConfigError("; ".join(problems))
        numbers_ = {"speedup": float(arguments["speedup"]), "interval": int(arguments["interval"])}
        flags = {name: bool(arguments[name]) for name in ("calibrate", "log_images")}
        patterns = {name: tuple(arguments[name]) for name in ("train_always", "train_never")}
        return cls(**{**arguments, **numbers_, **flags, **patterns, "resolution": int(arguments["resolution"])})


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
