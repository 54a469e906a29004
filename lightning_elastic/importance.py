"""Per-tensor importance: the loss drop that each tensor's real optimizer update brings.

For one optimizer step ``w -> w + dw`` tensor ``k`` contributes, to first order,

    I_k = - sum_i g_i * dw_i        (sum over the elements of tensor k)

``dw`` is whatever the optimizer really did (momentum, Adam moments, weight decay, clipping, a skipped AMP
step): it is read off the weights, never re-derived. ``g`` is, by default, ``g(w)``, the gradient the step
consumed. The trapezoid rule ``(g(w) + g(w + dw)) / 2`` is exact for a quadratic loss when both gradients
come from one batch, but in training ``g(w + dw)`` is the next optimizer step's gradient, on another batch,
and that batch's noise makes the ranking worse (docs/importance.md: Spearman 0.59 against 0.99 for the
before-gradient on one held-out batch of a real fine-tuning run); ``gradient="average"`` keeps it selectable,
with the before-gradient standing alone where the next step brings none (end of the window, tensor frozen
then). The ElasticTrainer reference uses the after-gradient alone. Importance is kept per step over a window of
consecutive real training steps (``importance_window``): summed, and reduced to a trimmed mean per step so that
one outlier step does not dominate the window.

:class:`ImportanceEvaluator` only reads gradients and weights. With the default before-gradient it keeps no
copy of the weights: ``g . dw = g . w_after - g . w_before``, both summed in float64 (docs/memory.md); the
modes that read the after-gradient keep one copy of the trained tensors between ``before_step`` and the next
step (the old weights, turned into ``-dw`` in place after the step).
:func:`true_loss_drop` is the brute-force reference that the estimate is checked against.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, get_args

import torch
from torch import Tensor

from lightning_elastic.importance_window import ImportanceWindow, Record

Gradient = Literal["average", "before", "after"]
GRADIENTS: tuple[str, ...] = get_args(Gradient)


class ImportanceEvaluator:
    """Accumulates ``I_k = -sum g * dw`` per tensor over a window of optimizer steps.

    Call ``before_step()`` once the gradients are final (after backward and AMP unscaling) and
    before ``optimizer.step()``, and ``after_step()`` right after it, before the gradients are zeroed.
    The next ``before_step()`` reads the after-gradient of the previous update; ``finish()`` settles the
    last update with its before-gradient alone and frees the weight copies. Tensors whose ``.grad`` is
    ``None`` at ``before_step()`` are frozen for that step: they are skipped and cost nothing.

    Training is never disturbed: weights, gradients, ``requires_grad`` and optimizer state are only read.
    Each step's contributions are kept on the parameters' devices and moved to the CPU (float64) once per read
    of :attr:`importance` or :attr:`per_step`. A non-finite after-gradient falls back to the before-gradient;
    a contribution that is still not finite (a NaN or inf gradient, an AMP step skipped on overflow) is left
    out of the sums and out of :attr:`counts`, and counted in :attr:`nonfinite`.

    Args:
        params: The tensors to evaluate, in the order of the importance vector (forward order).
        gradient: Which gradient ``g`` multiplies the update: the ``"before"``-gradient, the one the step
            consumed (first-order Taylor at ``w``; no after-gradient is read), the ``"average"`` of the before-
            and after-gradient, or the ``"after"``-gradient alone (the ElasticTrainer reference). During
            training the after-gradient is the next batch's, and its batch noise makes the average rank tensors
            worse than the before-gradient alone (docs/importance.md measures it), hence the default. Without an
            after-gradient the before-gradient stands in.

    Raises:
        TypeError: If ``params`` is one tensor or holds a non-tensor.
        ValueError: If ``params`` is empty, holds a tensor that is not floating point or the same tensor
            twice, or ``gradient`` is not one of the above.

    Example:
        >>> model = torch.nn.Linear(3, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> evaluator = ImportanceEvaluator(list(model.parameters()))
        >>> for _ in range(3):
        ...     model(torch.ones(4, 3)).square().mean().backward()
        ...     evaluator.before_step()
        ...     optimizer.step()
        ...     evaluator.after_step()
        ...     optimizer.zero_grad()
        >>> evaluator.finish()
        >>> evaluator.importance.shape, evaluator.importance.dtype, evaluator.steps
        (torch.Size([2]), torch.float64, 3)
    """

    def __init__(self, params: Iterable[Tensor], gradient: Gradient = "before") -> None:
        if gradient not in GRADIENTS:
            raise ValueError(f"`gradient` must be one of {GRADIENTS}. Found: {gradient!r}")
        self._params: list[Tensor] = _check_params(params)
        self._gradient = gradient
        n = len(self._params)
        self._window = ImportanceWindow(n)
        # w_old between before_step and after_step, then -dw until the next before_step settles it.
        self._buffers: dict[int, Tensor] = {}
        self._open: dict[torch.device, list[int]] | None = None
        self._pending: list[Record] = []
        self._nan: dict[torch.device, Tensor] = {}
        self._before_dots: dict[int, Tensor] = {}  # "before": g.w at before_step, per open tensor

    @property
    def importance(self) -> Tensor:
        """Accumulated ``I_k``, shape ``(N,)``, float64 on the CPU.

        The latest update counts with its before-gradient alone until the next ``before_step()``
        brings its after-gradient, so this is always what ``finish()`` would leave now.
        """
        return self._window.total(self._pending)

    @property
    def per_step(self) -> Tensor:
        """Each tensor's importance per step: a trimmed mean over the steps that measured it (``importance_window``).

        Shape ``(N,)``, float64 on the CPU, 0 for a tensor no step measured. Like :attr:`importance`, it counts the
        latest update with its before-gradient alone until the next ``before_step()``. One outlier step does not
        dominate it once three steps measured the tensor.
        """
        return self._window.per_step(self._pending)

    @property
    def counts(self) -> list[int]:
        """Per tensor, the optimizer steps of the window that measured it (frozen or non-finite steps do not count)."""
        return self._window.counts

    @property
    def nonfinite(self) -> list[int]:
        """Per tensor, the steps of the window whose contribution was not finite and was left out."""
        return self._window.nonfinite

    @property
    def steps(self) -> int:
        """Optimizer steps counted in the window (``after_step()`` calls since the last ``reset()``)."""
        return self._window.steps

    @property
    def in_step(self) -> bool:
        """Whether ``before_step()`` was called and its ``after_step()`` is still to come."""
        return self._open is not None

    @torch.no_grad()
    def before_step(self) -> None:
        """Settle the previous update with the current gradients and copy the weights about to change.

        Raises:
            RuntimeError: If the previous ``before_step()`` has no ``after_step()``, or a gradient is
                not a dense tensor.
        """
        if self._open is not None:
            raise RuntimeError(_ORDER + " Found: before_step() twice without after_step() in between")
        grads = [p.grad for p in self._params]
        self._settle(grads)
        active: dict[torch.device, list[int]] = {}
        for k, grad in enumerate(grads):
            if grad is None:
                self._buffers.pop(k, None)  # frozen for this step: free its copy
                continue
            if grad.layout != torch.strided:
                raise RuntimeError(f"Importance needs dense gradients. Found: a {grad.layout} gradient for tensor {k}")
            if self._gradient == "before":
                # g.w before and after the step give g.dw without a copy of the weights (a full model's worth of
                # memory in probe windows); float64 sums keep the difference exact to ~1e-16 of g.w
                self._before_dots[k] = _dot64(grad, self._params[k])
            elif k not in self._buffers:
                self._buffers[k] = torch.empty_like(self._params[k])
            active.setdefault(grad.device, []).append(k)
        if self._gradient != "before":
            for indices in active.values():
                torch._foreach_copy_([self._buffers[k] for k in indices], [self._params[k] for k in indices])
        self._open = active

    @torch.no_grad()
    def after_step(self) -> None:
        """Turn the weight copies into ``-dw`` and take the before-gradient part of the importance.

        Raises:
            RuntimeError: If ``before_step()`` was not called first, or a gradient that existed at
                ``before_step()`` is gone (``after_step()`` must come before ``zero_grad()``).
        """
        if self._open is None:
            raise RuntimeError(_ORDER + " Found: after_step() without before_step() before it")
        step = self._window.steps
        for indices in self._open.values():
            grads: list[Tensor] = []
            missing: list[int] = []
            for k in indices:
                grad = self._params[k].grad
                if grad is None:
                    missing.append(k)
                else:
                    grads.append(grad)
            if missing:
                raise RuntimeError(
                    _ORDER + " Call after_step() before the gradients are zeroed. Found: no gradient "
                    f"at after_step() for tensors {missing}, which had one at before_step()"
                )
            # Optimizers leave .grad as they found it: it is still the gradient the step consumed.
            if self._gradient == "before":
                after = [_dot64(g, self._params[k]) for g, k in zip(grads, indices, strict=True)]
                before = torch.stack([self._before_dots[k] - a for k, a in zip(indices, after, strict=True)])
                self._window.add((step, indices, before))
                continue
            buffers = [self._buffers[k] for k in indices]
            torch._foreach_sub_(buffers, [self._params[k] for k in indices])
            before = torch.stack([_dot(g, b) for g, b in zip(grads, buffers, strict=True)])
            self._pending.append((step, indices, before))
        self._window.close_step(k for indices in self._open.values() for k in indices)
        self._open = None

    @torch.no_grad()
    def finish(self) -> None:
        """Close the window: settle the last update with its before-gradient alone and free the copies.

        A step opened by ``before_step()`` without ``after_step()`` is dropped: its update did not happen.
        This lets a caller read the last update's after-gradient at the next step's ``before_step()``,
        then finish.
        """
        self._settle([None] * len(self._params))
        self._open = None
        self._buffers = {}

    def reset(self) -> None:
        """Start a new window: zero the sums and the step count, drop pending updates and copies."""
        self._window.reset()
        self._drop_updates()

    def state_dict(self) -> dict[str, Any]:
        """Plain data: ``{"importance": list of N floats, "steps": int, "counts": list of N ints}``.

        The weight copies are not saved: a restored evaluator counts the latest update with its
        before-gradient alone (as :attr:`importance` does) and drops an open step.
        """
        return self._window.state_dict(self._pending)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the sums and step count of :meth:`state_dict`; pending updates and copies are dropped.

        Raises:
            ValueError: If ``state`` does not hold ``N`` finite importances and a non-negative step count.
        """
        self._window.load_state_dict(state)
        self._drop_updates()

    def _drop_updates(self) -> None:
        """Forget the updates in flight: the open step, the pending one and the weight copies."""
        self._buffers = {}
        self._open = None
        self._pending = []

    def _settle(self, grads: Sequence[Tensor | None]) -> None:
        """Move the pending update into the records, averaging in the after-gradient where there is one."""
        for step, indices, before in self._pending:
            device = before.device
            after = torch.stack(
                [
                    _dot(grad, self._buffers[k]) if (grad := grads[k]) is not None else self._nan_on(device)
                    for k in indices
                ]
            )
            combined = (before + after) * 0.5 if self._gradient == "average" else after
            # A missing or non-finite after-gradient (frozen now, AMP overflow) leaves the before-gradient.
            self._window.add((step, indices, torch.where(after.isfinite(), combined, before)))
        self._pending = []

    def _nan_on(self, device: torch.device) -> Tensor:
        if device not in self._nan:
            self._nan[device] = torch.full((), math.nan, device=device)
        return self._nan[device]


def true_loss_drop(loss: Callable[[], Tensor], params: Sequence[Tensor], updates: Sequence[Tensor | None]) -> Tensor:
    """Brute-force loss drop of each update alone: ``L(w) - L(w + dw_k e_k)`` for every tensor ``k``.

    Each update is added to its tensor, the loss evaluated, and the tensor restored bit for bit; one loss
    evaluation per tensor plus one. Tensors whose update is ``None`` get 0. Use a deterministic loss
    (e.g. the model in ``eval()`` mode on a fixed batch) and, for small updates, float64 tensors.

    Args:
        loss: Evaluates the loss at the current values of ``params`` (called without autograd).
        params: The tensors.
        updates: One update per tensor (same shape), or ``None``.

    Returns:
        Shape ``(N,)``, float64 on the CPU.

    Raises:
        ValueError: If ``params`` and ``updates`` differ in length or an update's shape differs.

    Example:
        >>> w = torch.tensor([1.0, 2.0], dtype=torch.float64)
        >>> true_loss_drop(lambda: w.square().sum(), [w], [torch.tensor([-0.5, 0.0], dtype=torch.float64)])
        tensor([0.7500], dtype=torch.float64)
    """
    if len(params) != len(updates):
        raise ValueError(f"`updates` must hold one entry per tensor of `params` ({len(params)}). Found: {len(updates)}")
    for k, (p, dw) in enumerate(zip(params, updates, strict=True)):
        if dw is not None and dw.shape != p.shape:
            raise ValueError(
                f"`updates[{k}]` must have the shape of `params[{k}]` {tuple(p.shape)}. Found: {tuple(dw.shape)}"
            )
    drops = torch.zeros(len(params), dtype=torch.float64)
    with torch.no_grad():
        base = float(loss())
        for k, (p, dw) in enumerate(zip(params, updates, strict=True)):
            if dw is None:
                continue
            saved = p.clone()
            p.add_(dw)
            drops[k] = base - float(loss())
            p.copy_(saved)
    return drops


_ORDER = (
    "The expected order at each optimizer step is: backward, before_step(), optimizer.step(), "
    "after_step(), zero_grad()."
)


def _check_params(params: Iterable[Tensor]) -> list[Tensor]:
    if isinstance(params, Tensor):
        raise TypeError("`params` must be a sequence of tensors, not one tensor. Found: a Tensor")
    if not isinstance(params, Iterable):
        raise TypeError(f"`params` must be a sequence of tensors. Found: {type(params).__name__}")
    tensors = list(params)
    if not tensors:
        raise ValueError("`params` must hold at least one tensor. Found: an empty sequence")
    seen: dict[int, int] = {}
    for k, p in enumerate(tensors):
        if not isinstance(p, Tensor):
            raise TypeError(f"`params` must hold only tensors. Found: {type(p).__name__} at index {k}")
        if not p.is_floating_point():
            raise ValueError(f"`params` must hold floating-point tensors. Found: {p.dtype} at index {k}")
        if id(p) in seen:
            raise ValueError(f"`params` must not hold the same tensor twice. Found: indices {seen[id(p)]} and {k}")
        seen[id(p)] = k
    return tensors


def _dot(x: Tensor, y: Tensor) -> Tensor:
    """``sum(x * y)`` as a 0-dim tensor on their device; low-precision inputs are summed in float32.

    There is no foreach reduction that keeps the sign, and ``torch.dot`` needs no temporary the size of
    the tensor, so this is one small kernel per tensor.
    """
    if x.dtype not in (torch.float32, torch.float64):
        x, y = x.float(), y.float()
    return torch.dot(x.reshape(-1), y.reshape(-1))


def _dot64(x: Tensor, y: Tensor, chunk: int = 1 << 16) -> Tensor:
    """``sum(x * y)`` summed in float64, in chunks: temporaries stay a few MiB whatever the tensor's size."""
    if x.dtype == torch.float64 and y.dtype == torch.float64:
        return torch.dot(x.reshape(-1), y.reshape(-1))
    flat_x, flat_y = x.reshape(-1), y.reshape(-1)
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    for start in range(0, flat_x.numel(), chunk):
        total += torch.dot(flat_x[start : start + chunk].double(), flat_y[start : start + chunk].double())
    return total
