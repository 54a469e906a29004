"""Analytic backward costs of torch operations, the fallback of the timing profiler.

`op_costs` looks at one call of a torch function (as a ``TorchFunctionMode`` sees it: the function, its
arguments and its result) and estimates the work its backward pass does, split into the part that
propagates the gradient to the inputs (``dx``, paid whenever an input needs a gradient) and the part
that computes the gradient of each parameter argument (``dw``, paid only when that parameter is
trained). Units are "flop equivalents": multiply-adds count two, and memory-bound work (element-wise
ops, reductions, normalisation) counts ``mem_weight`` per element touched, because such work runs far
below the arithmetic peak. The profiler scales the totals to one measured training step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__ = ["OpCosts", "default_mem_weight", "op_costs"]

# Functions that only re-index memory: free in the forward pass, and their backward is another view or
# a cheap copy that the neighbouring ops dominate.
_VIEW_OPS = frozenset(
    {
        "view",
        "reshape",
        "flatten",
        "unflatten",
        "permute",
        "transpose",
        "t",
        "contiguous",
        "expand",
        "expand_as",
        "squeeze",
        "unsqueeze",
        "view_as",
        "narrow",
        "unbind",
        "split",
        "chunk",
        "detach",
        "__get__",
        "size",
        "dim",
        "numel",
    }
)
_CONV_OPS = frozenset({"conv1d", "conv2d", "conv3d", "convolution"})
_CONV_T_OPS = frozenset({"conv_transpose1d", "conv_transpose2d", "conv_transpose3d"})
_NORM_OPS = frozenset({"batch_norm", "layer_norm", "group_norm", "instance_norm", "rms_norm"})
_MATMUL_OPS = frozenset({"matmul", "mm", "bmm", "__matmul__", "__rmatmul__"})


@dataclass
class OpCosts:
    """Backward work of one operation, in flop equivalents.

    Attributes:
        dx: work that propagates the gradient to the operation's tensor inputs.
        dw: work that computes each parameter's gradient, keyed by the parameter's ``id``.
    """

    dx: float = 0.0
    dw: dict[int, float] = field(default_factory=dict)


def default_mem_weight(device: torch.device) -> float:
    """Flop equivalents of touching one element in memory-bound work on ``device``.

    Roughly the ratio of arithmetic throughput to element throughput: a CPU core does tens of
    flops in the time it streams one float through memory, a GPU hundreds.

    Example:
        >>> default_mem_weight(torch.device("cpu"))
        30.0
    """
    return 30.0 if device.type == "cpu" else 200.0


def tensors_in(obj: Any) -> list[Tensor]:
    """Every tensor in a nest of tensors, lists, tuples and mappings, depth first."""
    if isinstance(obj, Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in tensors_in(item)]
    if isinstance(obj, Mapping):
        return [t for item in obj.values() for t in tensors_in(item)]
    return []


def _float_numel(obj: Any) -> int:
    return sum(t.numel() for t in tensors_in(obj) if t.is_floating_point())


def _split_params(
    params: Sequence[Tensor], weight_cost: Callable[[Tensor], float], mem_cost: float
) -> dict[int, float]:
    """Gradient work of each parameter: ``weight_cost`` for matrices and kernels, ``mem_cost`` for vectors."""
    return {id(p): weight_cost(p) if p.dim() >= 2 else mem_cost for p in params}


def op_costs(
    name: str,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    out: Any,
    params: Sequence[Tensor],
    mem_weight: float,
) -> OpCosts:
    """Estimate the backward work of one call of a torch function.

    Args:
        name: the function's ``__name__`` (``"conv2d"``, ``"linear"``, ``"add"``...).
        args: its positional arguments.
        kwargs: its keyword arguments.
        out: what it returned.
        params: the parameters among its arguments (their gradients are the ``dw`` part).
        mem_weight: flop equivalents per element of memory-bound work (see `default_mem_weight`).

    Returns:
        The ``dx`` and per-parameter ``dw`` work.

    Example:
        >>> import torch.nn.functional as F
        >>> x, w = torch.randn(8, 16), torch.nn.Parameter(torch.randn(4, 16))
        >>> costs = op_costs("linear", (x, w), {}, F.linear(x, w), [w], mem_weight=30.0)
        >>> costs.dx, costs.dw[id(w)]
        (1024.0, 1024.0)
    """
    outs = [t for t in tensors_in(out) if t.is_floating_point()]
    if not outs or name in _VIEW_OPS:
        return OpCosts()
    out0 = outs[0]
    out_numel = float(out0.numel())
    mem = mem_weight * out_numel
    if name in _CONV_OPS or name in _CONV_T_OPS:
        weight = args[1] if len(args) > 1 else kwargs["weight"]
        # Each output element (convolution) or input element (transposed convolution) is a dot product
        # over one kernel slice of the weight.
        positions = out_numel if name in _CONV_OPS else float(tensors_in(args[0])[0].numel())
        flops = 2.0 * positions * weight[0].numel()
        return OpCosts(dx=flops, dw=_split_params(params, lambda p: flops, mem))
    if name == "linear":
        rows = out_numel / max(out0.shape[-1], 1)
        return OpCosts(
            dx=2.0 * out_numel * tensors_in(args[0])[0].shape[-1],
            dw=_split_params(params, lambda p: 2.0 * rows * p.numel(), mem),
        )
    if name in _MATMUL_OPS or name in {"addmm", "baddbmm", "addbmm", "einsum"}:
        operands = [t for t in tensors_in(args) if t.is_floating_point()]
        inner = operands[-1].shape[-2] if operands[-1].dim() >= 2 else operands[-1].shape[-1]
        flops = 2.0 * out_numel * inner
        # The gradient of each matrix operand is one product of the same size as the forward one.
        grads = [t for t in operands if t.dim() >= 2][-2:]
        dw = {id(p): flops for p in params if any(p is t for t in grads)}
        dw.update({id(p): mem for p in params if id(p) not in dw})
        n_data = sum(1 for t in grads if not any(t is p for p in params))
        return OpCosts(dx=flops * n_data, dw=dw)
    if name == "scaled_dot_product_attention":
        q, k = tensors_in(args)[:2]
        flops = 4.0 * q.numel() * k.shape[-2]
        return OpCosts(dx=2.5 * flops)
    if name == "multi_head_attention_forward":
        return _mha_costs(args, kwargs, params, out0, mem_weight)
    if name in _NORM_OPS:
        # Backward re-reads input, output gradient and statistics: a few passes over the activation.
        return OpCosts(dx=3.0 * mem, dw={id(p): mem for p in params})
    if name == "embedding":
        return OpCosts(dw={id(p): mem for p in params})
    return OpCosts(dx=mem, dw={id(p): mem for p in params})


def _mha_costs(
    args: Sequence[Any], kwargs: Mapping[str, Any], params: Sequence[Tensor], out: Tensor, mem_weight: float
) -> OpCosts:
    """``F.multi_head_attention_forward``: input projection, attention, output projection."""
    query = tensors_in(args[0])[0]
    embed = float(query.shape[-1])
    tokens = query.numel() / embed
    seq = float(query.shape[0])  # (L, N, E) layout inside the functional form
    # The attention work does not depend on how the width is split into heads.
    attention = 4.0 * tokens * seq * embed
    projections = 2.0 * tokens * 4.0 * embed * embed
    dw = _split_params(params, lambda p: 2.0 * tokens * p.numel(), mem_weight * tokens)
    return OpCosts(dx=projections + 2.5 * attention, dw=dw)
