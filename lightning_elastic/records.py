"""Typed records that pass between the method's parts: a trainable set, a selection with what it cost, and the
step costs a selection is decided against.

History, logging, checkpoints, the summary and TensorBoard all read these; checkpoints store them as plain data
(`to_dict` / `from_dict`), and `from_dict` still reads the mask strings of version-1 checkpoints.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

from lightning_elastic.time_model import StepTimeModel


@dataclass(frozen=True)
class Mask(Sequence[bool]):
    """Which tensors train: one flag per tensor in forward order (index 0 nearest the input).

    Example:
        >>> mask = Mask.of([False, True, True])
        >>> len(mask), mask.count(True), mask.deepest, mask.trained(["a", "b", "c"])
        (3, 2, 1, ['b', 'c'])
        >>> Mask.from_bits(mask.bits()) == mask
        True
    """

    flags: tuple[bool, ...]

    @classmethod
    def of(cls, flags: Sequence[bool]) -> Mask:
        """A mask of any sequence of truthy values."""
        return flags if isinstance(flags, Mask) else cls(tuple(bool(f) for f in flags))

    @classmethod
    def from_bits(cls, bits: str) -> Mask:
        """The mask of a string of "0" and "1" (how checkpoints and JSON keep it)."""
        if set(bits) - {"0", "1"}:
            raise ValueError(f"`bits` must be a string of '0' and '1'. Found: {bits!r:.60}")
        return cls(tuple(c == "1" for c in bits))

    def bits(self) -> str:
        """The mask as a string of "0" and "1"."""
        return "".join("1" if f else "0" for f in self.flags)

    @overload
    def __getitem__(self, index: int) -> bool: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[bool]: ...
    def __getitem__(self, index: int | slice) -> bool | Sequence[bool]:
        return self.flags[index]

    def __len__(self) -> int:
        return len(self.flags)

    def __iter__(self) -> Iterator[bool]:
        return iter(self.flags)

    @property
    def deepest(self) -> int | None:
        """The lowest trained index (where backward stops), or None when nothing trains."""
        return next((k for k, f in enumerate(self.flags) if f), None)

    def trained(self, names: Sequence[str]) -> list[str]:
        """The names of the trained tensors."""
        return [n for n, f in zip(names, self.flags, strict=True) if f]

    def elements(self, numel: Sequence[int]) -> int:
        """How many parameter elements train."""
        return sum(n for n, f in zip(numel, self.flags, strict=True) if f)


@dataclass(frozen=True)
class Decision:
    """What the selector decided for the next interval, and the time figures it decided on.

    Attributes:
        mask: the tensors to train.
        importance: the importance of every tensor that the decision used.
        predicted_seconds: the time model's step time of `mask`.
        target_seconds: the step time the selection had to fit (from the wall-clock plan).
        starved: True when no selection fitted the target and the cheapest one was taken instead.
    """

    mask: Mask
    importance: tuple[float, ...]
    predicted_seconds: float
    target_seconds: float
    starved: bool = False


@dataclass(frozen=True)
class SelectionRecord:
    """One re-selection: when it happened, what it decided, and the steps it then took.

    Attributes:
        step: the optimizer step at which the selection came into force, counted from the fit's start (the global step
            in a fit from step 0; `Trainer.fit` called again to train longer counts from where it started).
        epoch: the epoch it came into force in.
        decision: the decision.
        full_seconds: the full training step's seconds that the decision was made against.
        measured_seconds: the measured seconds of every step trained under it (filled when its interval closes).
        replanned: True when it replaced a selection whose first steps measured off the plan (`terms.off_plan`),
            not at a scheduled selection.

    Example:
        >>> record = SelectionRecord(4, 1, Decision(Mask.of([True]), (0.5,), 0.2, 0.25), full_seconds=0.5)
        >>> SelectionRecord.from_dict(record.to_dict()) == record
        True
    """

    step: int
    epoch: int
    decision: Decision
    full_seconds: float
    measured_seconds: tuple[float, ...] = field(default=())
    replanned: bool = False

    @property
    def mask(self) -> Mask:
        """The tensors trained under this selection."""
        return self.decision.mask

    @property
    def measured_step(self) -> float:
        """Mean measured seconds of a step under this selection (NaN before its interval closed)."""
        steps = self.measured_seconds
        return math.fsum(steps) / len(steps) if steps else math.nan

    def to_dict(self) -> dict[str, Any]:
        """Plain data for checkpoints and JSON."""
        d = self.decision
        return {
            "step": self.step,
            "epoch": self.epoch,
            "mask": d.mask.bits(),
            "importance": list(d.importance),
            "predicted_seconds": d.predicted_seconds,
            "target_seconds": d.target_seconds,
            "starved": d.starved,
            "full_seconds": self.full_seconds,
            "measured_seconds": list(self.measured_seconds),
            "replanned": self.replanned,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SelectionRecord:
        """Read `to_dict` output back; version-1 checkpoints (`budget_seconds`, `selected_steps`) too."""
        mask = Mask.from_bits(str(data["mask"]))
        target = data.get("target_seconds", math.nan)  # version 1 kept the backward budget instead
        return cls(
            step=int(data["step"]),
            epoch=int(data["epoch"]),
            decision=Decision(
                mask=mask,
                importance=tuple(float(v) for v in data.get("importance", [0.0] * len(mask))),
                predicted_seconds=float(data["predicted_seconds"]),
                target_seconds=float(target),
                starved=bool(data.get("starved", False)),
            ),
            full_seconds=float(data["full_seconds"]),
            measured_seconds=tuple(float(s) for s in data.get("measured_seconds", data.get("selected_steps", []))),
            replanned=bool(data.get("replanned", False)),
        )


@dataclass(frozen=True)
class StepTerms:
    """The step costs a selection is decided against.

    Attributes:
        model: the time model (made to predict the measured full step, when there is one).
        full: seconds of a full training step.
        optimizer: seconds of the optimizer update of every tensor (0 when not measured).
        target: seconds a selected step may take, as `model` predicts it.
        loop: seconds between two steps that every step pays (loading the batch, the loop; 0 when not measured).
    """

    model: StepTimeModel
    full: float
    optimizer: float
    target: float
    loop: float = 0.0
