"""Units of selection: the tensors that a selection trains or freezes together.

Selected one by one, the tensors of a layer come apart: under Adam a tensor's importance ``-g . dw`` grows with its
element count, so a selection of EfficientNet-Lite0 on ELPV trained the large convolution weights of the late blocks
(84% of the elements, 19-21% of the tensors) and left out the BatchNorm weight and bias beside each, which cost almost
nothing to train. Static freezing of a suffix trains them together, and matched or beat it. `layer_units` keeps each
parametrised module's tensors together, with those of a normalisation layer right after it in forward order (a
convolution and its BatchNorm, an attention output and its LayerNorm); docs/results.md has the measurements.

`Units` turns the selection problem over tensors into the same problem over units, exactly: the step time model
(`StepTimeModel`) of the units prices every union of whole units as the tensor model does, so the dynamic program of
`selector` solves it unchanged. `Units.expand` turns the units chosen back into tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from torch import nn

from lightning_elastic.records import Mask
from lightning_elastic.time_model import StepTimeModel

UnitKind = Literal["layer", "tensor"]
UNIT_KINDS: tuple[str, ...] = get_args(UnitKind)

# Normalisation layers: `_NormBase` is every BatchNorm and InstanceNorm; RMSNorm exists from torch 2.4.
_NORMS: tuple[type[nn.Module], ...] = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm) + (
    (nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()
)


@dataclass(frozen=True)
class Units:
    """Contiguous groups of tensor indices, in forward order, that together cover every tensor once.

    The problem over units has one more unit than `groups`: an empty one above the last, never selectable, that
    carries what the last unit's tensors after its first add to the backward pass (`model`).

    Example:
        >>> units = Units(((0,), (1, 2)))
        >>> model = StepTimeModel(t_dw=(1.0, 2.0, 0.5), t_dy=(4.0, 3.0, 1.0), t_fixed=10.0)
        >>> units.model(model).t_dw, units.model(model).t_dy
        ((1.0, 2.5, 0.0), (4.0, 3.0, 1.0))
        >>> units.expand([False, True, False], forbidden=[False] * 3).flags
        (False, True, True)
    """

    groups: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        flat = [k for group in self.groups for k in group]
        if flat != list(range(len(flat))) or any(not group for group in self.groups):
            shown = f"{self.groups}"  # long for a big model: its start is enough
            raise ValueError(f"`groups` must split 0..N-1 into contiguous non-empty runs, in order. Found: {shown:.80}")

    @classmethod
    def tensors(cls, n: int) -> Units:
        """Every tensor a unit of its own (the method as published)."""
        return cls(tuple((k,) for k in range(n)))

    @classmethod
    def of(cls, kind: UnitKind, module: nn.Module, names: Sequence[str]) -> Units:
        """The units of `kind` for the parameters `names` (forward order) of `module`."""
        return layer_units(module, names) if kind == "layer" else cls.tensors(len(names))

    @property
    def size(self) -> int:
        """The number of tensors."""
        return sum(len(group) for group in self.groups)

    def model(self, model: StepTimeModel) -> StepTimeModel:
        """The step time model over units, the empty unit above the last included.

        A unit's weight-gradient time is the sum of its tensors'; the backward pass down to a unit's first tensor
        passes the ops of every tensor above it, so the deepest selected unit ``d`` charges the ``t_dy`` of its own
        tensors after the first as well as of all the units above. The dynamic program charges a deepest unit the
        ``t_dy`` of the units above it only, so each unit carries its first tensor's ``t_dy`` plus what the unit
        below it adds past its own first tensor, and the empty unit above the last carries the last unit's: the sum
        over the units above ``d`` is then exactly ``sum_{i > first(d)} t_dy[i]``.
        """
        t_dw: list[float] = []
        t_dy: list[float] = []
        inner_below = 0.0
        for group in self.groups:
            t_dw.append(sum(model.t_dw[k] for k in group))
            t_dy.append(model.t_dy[group[0]] + inner_below)
            inner_below = sum(model.t_dy[k] for k in group[1:])
        return StepTimeModel(
            t_dw=(*t_dw, 0.0), t_dy=(*t_dy, inner_below), t_fixed=model.t_fixed, t_tail=model.t_tail
        )

    def values(self, importance: Sequence[float]) -> list[float]:
        """Each unit's importance: the sum of its tensors' (first-order loss drops add up); 0 for the empty unit."""
        return [*(sum(float(importance[k]) for k in group) for group in self.groups), 0.0]

    def required(self, required: Sequence[bool]) -> list[bool]:
        """A unit is required when any of its tensors is (it is selected whole)."""
        return [*(any(required[k] for k in group) for group in self.groups), False]

    def forbidden(self, forbidden: Sequence[bool], required: Sequence[bool]) -> list[bool]:
        """A unit is forbidden when every tensor of it is and none is required; the empty unit always is."""
        return [
            *(all(forbidden[k] for k in group) and not any(required[k] for k in group) for group in self.groups),
            True,
        ]

    def expand(self, chosen: Sequence[bool], forbidden: Sequence[bool]) -> Mask:
        """The tensors of the `chosen` units (the empty unit's flag, if given, is ignored), less the forbidden ones.

        A forbidden tensor left out of a chosen unit only makes the step cheaper than the units' model priced it.
        """
        flags = [False] * self.size
        for group, on in zip(self.groups, chosen, strict=False):
            for k in group:
                flags[k] = bool(on) and not forbidden[k]
        return Mask.of(flags)


def layer_units(module: nn.Module, names: Sequence[str]) -> Units:
    """Each parametrised module's tensors as one unit, a normalisation layer's joined to the module before it.

    `names` are parameter names of `module` in forward order (a profile's). A tensor joins the unit of the tensor
    before it when both belong to one module, or when it belongs to a normalisation layer and the tensor before it
    does not (a convolution and its BatchNorm; two normalisation layers in a row stay apart).

    Example:
        >>> net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Linear(4, 2))
        >>> layer_units(net, [name for name, _ in net.named_parameters()]).groups
        ((0, 1, 2, 3), (4, 5))
    """
    groups: list[list[int]] = []
    before: tuple[str, bool] | None = None  # the module path of the tensor before, and whether it normalises
    for k, name in enumerate(names):
        path = name.rpartition(".")[0]
        norm = isinstance(module.get_submodule(path), _NORMS)
        if before is not None and (path == before[0] or (norm and not before[1])):
            groups[-1].append(k)
        else:
            groups.append([k])
        before = (path, norm)
    return Units(tuple(tuple(group) for group in groups))
