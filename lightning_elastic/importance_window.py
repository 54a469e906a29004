"""The window importance is measured over: per-tensor sums of the steps' contributions, and what each step measured.

`ImportanceEvaluator` (`importance`) computes each optimizer step's contribution ``-g . dw`` per tensor on the
parameters' devices; `ImportanceWindow` adds them up (one transfer per device per read), counts the steps that
measured each tensor and the contributions left out for not being finite, and saves and restores all of it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

# Per step: the tensor indices of one device and their contributions (a vector on that device).
Record = tuple[list[int], Tensor]


class ImportanceWindow:
    """Per-tensor importance summed over the optimizer steps of one window, with what each step measured.

    Args:
        n: The number of tensors.

    Example:
        >>> window = ImportanceWindow(2)
        >>> window.add(([0, 1], torch.tensor([1.0, float("nan")])))
        >>> window.close_step([0, 1])
        >>> window.total().tolist(), window.counts, window.nonfinite
        ([1.0, 0.0], [1, 0], [0, 1])
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
        """Take one step's settled contributions of the tensors of one device (summed at the next read)."""
        self._records.append(record)

    def close_step(self, measured: Iterable[int]) -> None:
        """Count an optimizer step that measured the tensors `measured`."""
        for k in measured:
            self._counts[k] += 1
        self._steps += 1

    def total(self, pending: Sequence[Record] = ()) -> Tensor:
        """The sums, shape ``(N,)``, float64 on the CPU, with `pending` contributions (not yet settled) added."""
        self._flush()
        total = self._settled.clone()
        for indices, values in pending:
            total.index_add_(0, torch.tensor(indices), _finite(values).to("cpu", torch.float64))
        return total

    def reset(self) -> None:
        """Start a new window: zero the sums, the step count and the counts."""
        self._settled = torch.zeros(self._n, dtype=torch.float64)
        self._steps = 0
        self._counts = [0] * self._n
        self._nonfinite = [0] * self._n
        self._records: list[Record] = []

    def state_dict(self, pending: Sequence[Record] = ()) -> dict[str, Any]:
        """Plain data: ``{"importance": list of N floats, "steps": int, "counts": list of N ints}``."""
        return {"importance": self.total(pending).tolist(), "steps": self._steps, "counts": list(self._counts)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the sums, step count and counts of :meth:`state_dict`.

        Raises:
            ValueError: If ``state`` does not hold ``N`` finite importances and a non-negative step count.
        """
        importance, steps = state.get("importance"), state.get("steps")
        problem = _importance_problem(importance, self._n)
        if problem:
            raise ValueError(
                f"`state['importance']` must be a list of {self._n} finite numbers (one per tensor). Found: {problem}"
            )
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"`state['steps']` must be a non-negative int. Found: {steps!r}")
        self.reset()
        self._settled = torch.tensor(importance, dtype=torch.float64)
        self._steps = steps
        counts = state.get("counts")
        # Checkpoints without counts were taken in windows that train every tensor.
        n = self._n
        self._counts = [int(c) for c in counts] if isinstance(counts, list) and len(counts) == n else [steps] * n

    def _flush(self) -> None:
        """Add the recorded contributions to the CPU sums: one transfer per device."""
        by_device: dict[torch.device, tuple[list[int], list[Tensor]]] = {}
        for indices, values in self._records:
            all_indices, all_values = by_device.setdefault(values.device, ([], []))
            all_indices.extend(indices)
            all_values.append(values)
        for all_indices, all_values in by_device.values():
            values = torch.cat(all_values).to("cpu", torch.float64)
            for position in (~values.isfinite()).nonzero().flatten().tolist():
                self._nonfinite[all_indices[position]] += 1
            self._settled.index_add_(0, torch.tensor(all_indices), _finite(values))
        self._records = []


def _finite(values: Tensor) -> Tensor:
    # Non-finite only when a gradient or an update was: such a contribution measures nothing.
    return values.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


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
