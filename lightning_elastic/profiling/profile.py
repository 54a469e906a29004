"""The `TimingProfile` type and its one JSON reader and writer (`read_profile`, `store`), for the cache (`cache.py`),
checkpoints and the files users give; and the check that a profile describes a module (`mismatch`)."""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, get_args

from torch import nn

from lightning_elastic.errors import ElasticConfigError
from lightning_elastic.time_model import StepTimeModel

__all__ = ["TimeModel", "TimingMethod", "TimingProfile"]

TimingMethod = Literal["measured", "flops"]
# What the callback is told: a method, or "auto" (`harness.ProfileChoice`: the one the fit can pay for).
TimeModel = Literal["auto", "measured", "flops"]

FORMAT_VERSION = 2  # 2: `shapes`

class StaleProfileError(ValueError):
    """Profile data written in another format version."""


@dataclass(frozen=True)
class TimingProfile:
    """Per-tensor timings of one model on one device and the time model built on them.

    Attributes:
        names: parameter names (as ``model.named_parameters()`` gives them) in forward order, index 0
            nearest the input; tied parameters once; only parameters the forward pass uses.
        t_dw: seconds to compute each tensor's own gradient.
        t_dy: seconds to propagate the gradient through the op owning each tensor and the parameter-free
            ops between it and the previous tensor's op (one tensor per op carries it, the others get 0).
            ``t_dy[0]`` is reported as 0: nothing below the first tensor ever needs a gradient.
        t_fw: seconds of a plain forward pass (with the loss) when nothing requires grad.
        t_full: seconds of a plain forward + full backward pass.
        device: where it was measured, e.g. ``"cpu (2 threads)"`` or ``"cuda (NVIDIA H100)"``.
        fingerprint: the cache key (see `profile`).
        unused: parameters that require grad but that the forward pass does not use.
        method: ``"measured"`` or ``"flops"``.
        numel: elements of each tensor.
        shapes: each tensor's shape. A measured profile always has them; a profile built by hand may leave them None,
            and then only its element counts are checked against a module (`mismatch`).
        t_tail: seconds that every non-empty selection adds to ``t_fw``: backward of the loss and of the
            ops after the last tensor, graph recording of those ops and the autograd engine's start.
        profile_seconds: seconds that measuring this profile took.
        t_step: seconds of a steady full training step (forward, backward and the optimizer's update of every
            tensor) that a fit with this profile measured in the first probe window that timed one (`remember_step`);
            0 until one did. A later process's first window knows by it when it is warm (`warmup.cold_window_runs_on`).
        t_update: seconds of that step's optimizer update, measured with `t_step` (0: not known); the check before
            a later fit's first update shares it out by elements, as that fit's selections will (`begin`).

    Example:
        >>> p = TimingProfile(names=("a", "b"), t_dw=(2.0, 1.0), t_dy=(0.0, 3.0), t_fw=4.0, t_full=10.0,
        ...                   device="cpu (1 threads)", fingerprint="f", unused=(), method="measured",
        ...                   numel=(10, 10))
        >>> p.predict([True, False]), p.predict([False, True]), p.predict([False, False])
        (9.0, 5.0, 4.0)
    """

    names: tuple[str, ...]
    t_dw: tuple[float, ...]
    t_dy: tuple[float, ...]
    t_fw: float
    t_full: float
    device: str
    fingerprint: str
    unused: tuple[str, ...]
    method: TimingMethod
    numel: tuple[int, ...]
    t_tail: float = 0.0
    profile_seconds: float = 0.0
    t_step: float = 0.0
    shapes: tuple[tuple[int, ...], ...] | None = None
    t_update: float = 0.0

    def __post_init__(self) -> None:
        n = len(self.names)
        problems = [
            f"`{name}` has {len(getattr(self, name))} entries, `names` has {n}"
            for name in ("t_dw", "t_dy", "numel")
            if len(getattr(self, name)) != n
        ]
        if len(set(self.names)) != n:
            problems.append("`names` must be unique")
        if self.shapes is not None:
            if len(self.shapes) != n:
                problems.append(f"`shapes` has {len(self.shapes)} entries, `names` has {n}")
            problems += [
                f"`shapes[{i}]` has {math.prod(shape)} elements, `numel[{i}]` is {count}"
                for i, (shape, count) in enumerate(zip(self.shapes, self.numel, strict=False))
                if math.prod(shape) != count
            ]
        times = {
            "t_fw": self.t_fw, "t_full": self.t_full, "t_tail": self.t_tail, "t_step": self.t_step,
            "t_update": self.t_update,
        }  # fmt: skip
        times.update({f"t_dw[{i}]": v for i, v in enumerate(self.t_dw)})
        times.update({f"t_dy[{i}]": v for i, v in enumerate(self.t_dy)})
        problems += [
            f"`{key}` must be a finite number >= 0, got {value!r}"
            for key, value in times.items()
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf
        ]
        if not problems and self.t_fw > self.t_full:  # timings of a busy machine (`calibration.full_step_times`)
            problems.append(f"`t_fw` must be at most `t_full` (the forward is part of the step), got {self.t_fw!r}")
        if not problems and self.t_update > self.t_step:
            problems.append(f"`t_update` must be at most `t_step` (the update is part of it), got {self.t_update!r}")
        if self.method not in get_args(TimingMethod):
            problems.append(f"`method` must be one of {get_args(TimingMethod)}, got {self.method!r}")
        if problems:
            raise ValueError("Invalid `TimingProfile`: " + "; ".join(problems) + ".")

    @property
    def t_fixed(self) -> float:
        """Seconds that every non-empty selection pays: the forward pass and the always-paid backward."""
        return self.t_fw + self.t_tail

    def predict(self, mask: Sequence[bool]) -> float:
        """Seconds of one forward+backward pass with only the tensors selected by ``mask`` requiring grad.

        Args:
            mask: one flag per tensor of `names`.

        Returns:
            ``t_fw`` for an empty selection, else ``t_fixed + sum_k mask[k] * t_dw[k] + sum_{i>d} t_dy[i]``.

        Example:
            >>> p = TimingProfile(("a",), (1.0,), (0.0,), 2.0, 3.0, "cpu", "f", (), "measured", (4,))
            >>> p.predict([True])
            3.0
        """
        if len(mask) != len(self.names):
            raise ValueError(f"`mask` must have one entry per profiled tensor ({len(self.names)}). Found: {len(mask)}")
        return StepTimeModel.from_profile(self).predict(mask)

    def scaled(self, factor: float, forward: float | None = None) -> TimingProfile:
        """The profile with every time of the pass (`t_dw`, `t_dy`, `t_fw`, `t_full`, `t_tail`) times `factor`: the
        passes of an optimizer step over `factor` micro-batches, or the pass made to predict a measured step; with
        `forward`, the forward pass `t_fw` times that instead (and `t_full` as the sum of both parts).
        `t_step` and `t_update` (a training step a fit measured) and `profile_seconds` are no times of the pass and
        stay.

        Example:
            >>> p = TimingProfile(("a",), (1.0,), (0.5,), 2.0, 3.0, "cpu", "f", (), "measured", (4,), t_step=3.5)
            >>> q = p.scaled(4)
            >>> q.t_dw, q.t_dy, q.t_fw, q.t_full, q.t_step
            ((4.0,), (2.0,), 8.0, 12.0, 3.5)
            >>> r = p.scaled(0.5, forward=1.0)  # the backward half as long, the forward as it was
            >>> r.t_dw, r.t_fw, r.t_full
            ((0.5,), 2.0, 2.5)
        """
        ahead = factor if forward is None else forward
        return replace(
            self,
            t_dw=tuple(t * factor for t in self.t_dw),
            t_dy=tuple(t * factor for t in self.t_dy),
            t_fw=self.t_fw * ahead,
            t_full=self.t_fw * ahead + (self.t_full - self.t_fw) * factor,
            t_tail=self.t_tail * factor,
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data; `from_dict` reads it back.

        Example:
            >>> p = TimingProfile(("a",), (1.0,), (0.0,), 2.0, 3.0, "cpu", "f", (), "measured", (4,))
            >>> TimingProfile.from_dict(p.to_dict()) == p
            True
        """
        return {
            "version": FORMAT_VERSION,
            "names": list(self.names),
            "t_dw": list(self.t_dw),
            "t_dy": list(self.t_dy),
            "t_fw": self.t_fw,
            "t_full": self.t_full,
            "t_tail": self.t_tail,
            "device": self.device,
            "fingerprint": self.fingerprint,
            "unused": list(self.unused),
            "method": self.method,
            "numel": list(self.numel),
            "shapes": None if self.shapes is None else [list(shape) for shape in self.shapes],
            "profile_seconds": self.profile_seconds,
            "t_step": self.t_step,
            "t_update": self.t_update,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TimingProfile:
        """Rebuild a profile from `to_dict` output, validating every field.

        Raises:
            StaleProfileError: the format version differs (a `ValueError`).
            ValueError: a field is missing or has the wrong type.

        Example:
            >>> TimingProfile.from_dict({"version": 0})
            Traceback (most recent call last):
            ...
            lightning_elastic.profiling.profile.StaleProfileError: `data["version"]` must be 2. Found: 0
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"`data` must be a mapping. Found: {type(data).__name__}")
        if data.get("version") != FORMAT_VERSION:
            raise StaleProfileError(f'`data["version"]` must be {FORMAT_VERSION}. Found: {data.get("version")!r}')
        fields = {
            "names": str,
            "t_dw": float,
            "t_dy": float,
            "unused": str,
            "numel": int,
        }
        kwargs: dict[str, Any] = {}
        for key, kind in fields.items():
            value = data.get(key)
            if not isinstance(value, list) or not all(_is_kind(v, kind) for v in value):
                raise ValueError(f'`data["{key}"]` must be a list of {kind.__name__}. Found: {value!r:.80}')
            kwargs[key] = tuple(float(v) if kind is float else v for v in value)
        for key in ("t_fw", "t_full", "t_tail", "profile_seconds"):
            if not _is_kind(data.get(key), float):
                raise ValueError(f'`data["{key}"]` must be a number. Found: {data.get(key)!r}')
            kwargs[key] = float(data[key])
        for key in ("t_step", "t_update"):  # files written before fits remembered their step (its update) lack it
            if not _is_kind(data.get(key, 0.0), float):
                raise ValueError(f'`data["{key}"]` must be a number. Found: {data.get(key)!r}')
            kwargs[key] = float(data.get(key, 0.0))
        shapes = data.get("shapes")
        if shapes is not None:
            if not isinstance(shapes, list) or not all(
                isinstance(s, list) and all(_is_kind(d, int) for d in s) for s in shapes
            ):
                raise ValueError(f'`data["shapes"]` must be a list of lists of int, or null. Found: {shapes!r:.80}')
            kwargs["shapes"] = tuple(tuple(s) for s in shapes)
        for key in ("device", "fingerprint", "method"):
            if not isinstance(data.get(key), str):
                raise ValueError(f'`data["{key}"]` must be a string. Found: {data.get(key)!r}')
            kwargs[key] = data[key]
        return cls(**kwargs)


def _is_kind(value: Any, kind: type) -> bool:
    if isinstance(value, bool):
        return False
    if kind is float:
        return isinstance(value, (int, float))
    return isinstance(value, kind)


def mismatch(prof: TimingProfile, module: nn.Module) -> str | None:
    """Why ``prof`` does not describe ``module``'s parameters (names, shapes or, without `TimingProfile.shapes`,
    element counts, every trainable tensor), or None.

    Example:
        >>> prof = TimingProfile(("weight",), (1.0,), (0.0,), 1.0, 2.0, "cpu", "f", (), "measured", (6,),
        ...                      shapes=((2, 3),))
        >>> mismatch(prof, nn.Linear(3, 2, bias=False)) is None, mismatch(prof, nn.Linear(3, 2))
        (True, "trainable tensors it does not cover: ['bias']")
        >>> mismatch(prof, nn.Linear(2, 3, bias=False))
        "shapes that differ: ['weight ((2, 3) profiled, (3, 2) in the module)']"
    """
    named = dict(module.named_parameters())
    missing = [name for name in prof.names if name not in named]
    if missing:
        return f"names the module does not have: {missing[:5]}"
    if prof.shapes is not None:
        shapes = [
            f"{name} ({tuple(shape)} profiled, {tuple(named[name].shape)} in the module)"
            for name, shape in zip(prof.names, prof.shapes, strict=True)
            if tuple(named[name].shape) != tuple(shape)  # a hand-built profile may hold lists
        ]
        if shapes:
            return f"shapes that differ: {shapes[:5]}"
    sizes = [
        f"{name} ({count} elements profiled, {named[name].numel()} in the module)"
        for name, count in zip(prof.names, prof.numel, strict=True)
        if named[name].numel() != count
    ]
    if sizes:
        return f"element counts that differ: {sizes[:5]}"
    covered = set(prof.names) | set(prof.unused)
    uncovered = [name for name, p in named.items() if p.requires_grad and name not in covered]
    if uncovered:
        return f"trainable tensors it does not cover: {uncovered[:5]}"
    return None


def read_profile(path: Path) -> TimingProfile:
    """The profile saved at ``path`` (by `store` or as `TimingProfile.to_dict` JSON): the one reader of profile files.

    Raises:
        OSError: the file cannot be read.
        StaleProfileError: it was written in another format version.
        ValueError: it is not a valid profile (the message says why).
    """
    return TimingProfile.from_dict(json.loads(path.read_text()))


def store(path: Path, prof: TimingProfile) -> None:
    """Write atomically: a reader never sees a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(prof.to_dict(), handle, indent=1)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_given_profile(given: TimingProfile | str | os.PathLike[str] | None) -> TimingProfile | None:
    """The profile the user gave: as it is, or read from its JSON file."""
    if given is None or isinstance(given, TimingProfile):
        return given
    path = Path(given)
    try:
        return read_profile(path)
    except StaleProfileError as err:
        raise ElasticConfigError(
            f"`profile` must be a timing profile written in this version's file format ({FORMAT_VERSION}): profile "
            f"the model again, or leave `profile` unset and the fit profiles it. Found: {str(path)!r} ({err})"
        ) from err
    except (OSError, ValueError) as err:
        raise ElasticConfigError(
            f"`profile` must be a readable timing profile saved as JSON. Found: {str(path)!r} ({err})"
        ) from err
