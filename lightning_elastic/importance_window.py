"""The window importance is measured over: each step's per-tensor contributions, and their robust reduction.

`ImportanceEvaluator` (`importance`) computes each optimizer step's contribution ``-g . dw`` per tensor on the
parameters' devices; `ImportanceWindow` keeps them by step (one transfer per device per read), counts the steps
that measured each tensor and the contributions left out for not being finite, reduces them to a tensor's
importance per step, and saves and restores all of it.

The reduction is a trimmed mean over the steps that measured a tensor: ``max(1, m // 10)`` of its ``m`` values are
dropped at each end once ``m >= 3`` (so three steps give their median). One step's contribution is noisy and heavy
tailed (a batch with a large gradient, a loss spike, a warm-up step): under a plain mean one such step can outweigh
the rest of the window and flip the ranking. A median would resist it too, but importance is meant as an expected
loss drop, and the median of a skewed distribution is not its mean; trimming 10% a side keeps about 80% of the
steps. With one or two steps nothing tells an outlier from the rest: their mean is the value.

Keeping the steps costs host memory, not device memory: one float64 per tensor per step of the window (200 tensors
over a 1,000-step interval: 1.6 MB), freed as the window is read and reset.

`LatestImportance` keeps what each window measured of each tensor, and reads a value measured windows ago aged by
how far importance has fallen since (its docstring says why).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

# One step's contributions of the tensors of one device: the step, the tensor indices, their values (on that device).
Record = tuple[int, list[int], Tensor]
TRIM_ONE_IN = 10  # the trimmed mean drops one in ten of a tensor's steps at each end (at least one from three on)


class ImportanceWindow:
    """Per-tensor contributions of the optimizer steps of one window, with what each step measured.

    Args:
        n: The number of tensors.

    Example:
        >>> window = ImportanceWindow(2)
        >>> for step, value in enumerate([1.0, 2.0, 90.0]):
        ...     window.add((step, [0, 1], torch.tensor([value, float("nan")])))
        ...     window.close_step([0, 1])
        >>> window.total().tolist(), window.per_step().tolist(), window.counts, window.nonfinite
        ([93.0, 0.0], [2.0, 0.0], [3, 0], [0, 3])
    """

    def __init__(self, n: int) -> None:
        self._n = n
        self.reset()

    @property
    def counts(self) -> list[int]:
        """Per tensor, the optimizer steps of the window that measured it (frozen or non-finite steps do not count)."""
        self._flush()
        return [c - d for c, d in zip(self._counts, self._nonfinite, strict=True)]

    @property
    def nonfinite(self) -> list[int]:
        """Per tensor, the steps of the window whose contribution was not finite and was left out."""
        self._flush()
        return list(self._nonfinite)

    @property
    def steps(self) -> int:
        """Optimizer steps closed in the window since the last ``reset()``."""
        return self._steps

    def add(self, record: Record) -> None:
        """Take one step's settled contributions of the tensors of one device (moved to the CPU at the next read)."""
        self._records.append(record)

    def close_step(self, measured: Iterable[int]) -> None:
        """Count an optimizer step that measured the tensors `measured`."""
        for k in measured:
            self._counts[k] += 1
        self._steps += 1

    def total(self, pending: Sequence[Record] = ()) -> Tensor:
        """Per tensor, the sum of its finite contributions, shape ``(N,)``, float64 on the CPU.

        `pending` are contributions not yet settled (the latest update, waiting for its after-gradient).
        """
        return self._table(pending).nansum(dim=0)

    def per_step(self, pending: Sequence[Record] = ()) -> Tensor:
        """Per tensor, the trimmed mean of its finite contributions (see the module), 0 where none; float64, CPU."""
        table = self._table(pending)
        measured = table.isfinite().sum(dim=0)
        trim = torch.where(measured >= 3, (measured // TRIM_ONE_IN).clamp(min=1), 0)
        ordered = table.sort(dim=0).values  # NaN (not measured) sorts last
        position = torch.arange(table.shape[0]).unsqueeze(1)
        kept = (position >= trim) & (position < measured - trim)
        return torch.where(kept, ordered, 0.0).sum(dim=0) / (measured - 2 * trim).clamp(min=1)

    def reset(self) -> None:
        """Start a new window: forget the contributions, the step count and the counts."""
        self._steps = 0
        self._counts = [0] * self._n
        self._nonfinite = [0] * self._n
        self._records: list[Record] = []
        self._rows: dict[int, Tensor] = {}  # step -> (N,) float64, NaN where the step measured nothing finite

    def state_dict(self, pending: Sequence[Record] = ()) -> dict[str, Any]:
        """Plain data: ``{"importance": N floats (the sums), "steps": int, "counts": N ints, "per_step": rows}``.

        ``per_step`` holds one list of N entries per step, ``None`` where the step measured nothing finite.
        """
        table = self._table(pending)
        rows = [[v if math.isfinite(v) else None for v in row] for row in table.tolist()]
        return {
            "importance": table.nansum(dim=0).tolist(),
            "steps": self._steps,
            "counts": list(self._counts),
            "per_step": rows,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the contributions, step count and counts of :meth:`state_dict`.

        Checkpoints without ``per_step`` hold only the sums: each tensor then gets its mean repeated over its
        counted steps (the same sum and the same mean).

        Raises:
            ValueError: If ``state`` does not hold ``N`` finite importances, a non-negative step count, or per-step
                rows of ``N`` entries each.
        """
        importance, steps, rows = state.get("importance"), state.get("steps"), state.get("per_step")
        problem = _importance_problem(importance, self._n)
        if problem:
            raise ValueError(
                f"`state['importance']` must be a list of {self._n} finite numbers (one per tensor). Found: {problem}"
            )
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"`state['steps']` must be a non-negative int. Found: {steps!r}")
        if rows is not None and (problem := _rows_problem(rows, self._n)):
            raise ValueError(
                f"`state['per_step']` must be a list of rows of {self._n} numbers or None. Found: {problem}"
            )
        self.reset()
        self._steps = steps
        counts = state.get("counts")
        # Checkpoints without counts were taken in windows that train every tensor.
        n = self._n
        self._counts = [int(c) for c in counts] if isinstance(counts, list) and len(counts) == n else [steps] * n
        if rows is None:
            rows = _repeated_means(list(importance), self._counts)  # type: ignore[arg-type]  # checked above
        for step, row in enumerate(rows):
            self._rows[step] = torch.tensor([math.nan if v is None else v for v in row], dtype=torch.float64)

    def _table(self, pending: Sequence[Record]) -> Tensor:
        """Steps x tensors, float64 on the CPU, NaN where a step measured nothing finite; `pending` rows added."""
        self._flush()
        rows = dict(self._rows)
        for step, indices, values in pending:
            row = rows[step].clone() if step in rows else torch.full((self._n,), math.nan, dtype=torch.float64)
            finite = values.to("cpu", torch.float64)
            row[torch.tensor(indices)] = torch.where(finite.isfinite(), finite, math.nan)
            rows[step] = row
        if not rows:
            return torch.full((1, self._n), math.nan, dtype=torch.float64)
        return torch.stack([rows[step] for step in sorted(rows)])

    def _flush(self) -> None:
        """Move the recorded contributions into the CPU rows: one transfer per device, one assignment per step."""
        by_device: dict[torch.device, tuple[list[int], list[int], list[Tensor]]] = {}
        for step, indices, values in self._records:
            steps, all_indices, all_values = by_device.setdefault(values.device, ([], [], []))
            steps.extend([step] * len(indices))
            all_indices.extend(indices)
            all_values.append(values)
        for steps, all_indices, all_values in by_device.values():
            values = torch.cat(all_values).to("cpu", torch.float64)
            step_of, index = torch.tensor(steps), torch.tensor(all_indices)
            finite = values.isfinite()
            for k in index[~finite].tolist():  # a NaN or inf gradient or update: it measures nothing
                self._nonfinite[k] += 1
            for step in step_of.unique().tolist():
                if step not in self._rows:
                    self._rows[step] = torch.full((self._n,), math.nan, dtype=torch.float64)
                here = (step_of == step) & finite
                self._rows[step][index[here]] = values[here]
        self._records = []


@dataclass
class LatestImportance:
    """Each tensor's importance per step as last measured, and what a selection reads of it now (`now`).

    A tensor is measured only in the steps it trains: in probe windows every candidate, in between the selected
    ones. Importance falls as training goes on (the loss and its gradients shrink), for the frozen tensors as well:
    Lite0 on Fashion-MNIST at 2x (2 seeds), from the window of steps 0-5 to that of steps 196-199, the tensors never
    trained in between fell to 0.28 of their importance (median; quartiles 0.23-0.31, 208 tensors), those trained
    throughout to 0.21-0.22, and at step 100 the trained ones stood at 0.23. Read as measured, a value a window
    took 100 steps ago is about 4 times too large beside a fresh one, and each selection swapped the tensors it had
    trained for ones measured early (29 of 44 on one seed). So each fold measures how far importance fell since the
    values it replaces: `level` is multiplied by the median, over the tensors measured again (the pinned ones left
    out: a new head falls far faster), of new over aged old value; a value not measured again is read aged by the
    fall since it was measured.

    Attributes:
        values: per tensor, importance per step as last measured (0 until measured).
        levels: per tensor, the `level` when its value was measured.
        level: how far importance has fallen since the first measurement (1 at first).

    Example:
        >>> latest = LatestImportance.unmeasured(3)
        >>> latest.fold({0: 4.0, 1: 8.0, 2: 2.0}, pinned=[False] * 3)  # a probe window measures every tensor
        >>> latest.fold({0: 1.0, 1: 2.0}, pinned=[False] * 3)  # a selection trains 0 and 1: both fell to a quarter
        >>> latest.now()  # tensor 2, frozen, is read fallen alike
        [1.0, 2.0, 0.5]
    """

    values: list[float]
    levels: list[float]
    level: float = 1.0

    @classmethod
    def unmeasured(cls, n: int) -> LatestImportance:
        """`n` tensors, none measured yet."""
        return cls([0.0] * n, [1.0] * n)

    def now(self) -> list[float]:
        """Per tensor, its importance per step as it stands now: measured, aged by the fall since."""
        return [value * self.level / level for value, level in zip(self.values, self.levels, strict=True)]

    def fold(self, measured: Mapping[int, float], pinned: Sequence[bool]) -> None:
        """Take a window's importance per step of the tensors it `measured` (by index); `pinned` tensors (always
        trained) do not count in the fall. Only positive values, now and before, tell a ratio."""
        aged = self.now()
        ratios = [v / aged[k] for k, v in measured.items() if not pinned[k] and v > 0 and aged[k] > 0]
        if ratios:
            self.level *= statistics.median(ratios)
        for k, value in measured.items():
            self.values[k], self.levels[k] = value, self.level

    def state_dict(self) -> dict[str, Any]:
        """Plain data for checkpoints."""
        return {"latest": list(self.values), "latest_levels": list(self.levels), "level": self.level}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict` output of as many tensors; a checkpoint from before levels reads its values as of now.

        Example:
            >>> latest = LatestImportance.unmeasured(2)
            >>> latest.load_state_dict({"latest": [1.0, 2.0]})
            >>> latest
            LatestImportance(values=[1.0, 2.0], levels=[1.0, 1.0], level=1.0)
        """
        values = [float(v) for v in state["latest"]]
        self.level = float(state.get("level", 1.0))
        self.levels = [float(v) for v in state.get("latest_levels", [self.level] * len(values))]
        self.values = values


def _repeated_means(sums: Sequence[float], counts: Sequence[int]) -> list[list[float | None]]:
    """Rows that give each tensor `sums[k] / counts[k]` at each of its `counts[k]` steps (checkpoints of sums only)."""
    return [
        [s / c if step < c else None for s, c in zip(sums, counts, strict=True)]
        for step in range(max(counts, default=0))
    ]


def _importance_problem(value: object, n: int) -> str:
    """What is wrong with a saved importance vector of ``n`` entries, or "" when nothing is."""
    if not isinstance(value, Sequence) or isinstance(value, str):
        return repr(value)
    if len(value) != n:
        return f"{len(value)} entries"
    for k, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            return f"{v!r} at index {k}"
    return ""


def _rows_problem(rows: object, n: int) -> str:
    """What is wrong with saved per-step rows of ``n`` entries each, or "" when nothing is."""
    if not isinstance(rows, Sequence) or isinstance(rows, str):
        return repr(rows)
    for step, row in enumerate(rows):
        problem = _importance_problem([0.0 if v is None else v for v in row] if isinstance(row, list) else row, n)
        if problem:
            return f"{problem} in row {step}"
    return ""
