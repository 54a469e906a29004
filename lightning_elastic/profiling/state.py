"""What profiling may disturb in a model, snapshotted and restored."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn


class ModelState:
    """Snapshot of everything `profile` may disturb, restored bit-exactly.

    That is the parameters' ``requires_grad`` flags and ``.grad`` tensors, the buffers (BatchNorm running
    statistics; values and which tensor objects they are), train/eval modes, and every other attribute of every
    submodule: state that user code keeps in plain attributes, e.g. an RNN's ``self.hidden = ...`` set in
    ``forward``, gets its original object back, attributes added during profiling are removed, and plain tensor
    attributes updated in place get their values back, as do lists, dicts and sets appended to in place (their
    items, one level deep): the outputs a `training_step` collects for `on_train_epoch_end`, and the list states of a
    torchmetrics metric (`MulticlassAUROC(thresholds=None)` keeps every batch's predictions), which the profiler's
    calls of the step would otherwise leave holding its extra batches.
    """

    def __init__(self, model: nn.Module) -> None:
        self._params = list(model.parameters())
        self._flags = [p.requires_grad for p in self._params]
        self._grads = [p.grad for p in self._params]
        self._buffers = [
(buf, buf.detach().clone()) for module in model.modules() for buf in module._buffers.values() if buf is not None
        ]
        self._attributes = [(module, dict(vars(module))) for module in model.modules()]
        self._tensors = [
            (value, value.detach().clone())
            for _, saved in self._attributes
            for value in saved.values()
            if isinstance(value, Tensor) and not isinstance(value, nn.Parameter)
        ]
        # Plain copies of the contents, not `copy.copy` of each container: a module's own dicts (`_parameters`,
        # `_modules`, its hooks) are OrderedDicts, whose `copy.copy` goes through `__reduce_ex__` (Lite0's 2,784
        # containers: 8.6 ms, against 0.7 ms). A dict's as a mapping: `Counter.update` counts the items of anything
        # else.
        self._contents = [
            (value, dict(value) if isinstance(value, dict) else tuple(value))
            for _, saved in self._attributes
            for value in saved.values()
            if isinstance(value, (list, dict, set))
        ]
        self._modes = [(module, module.training) for module in model.modules()]

    def restore(self) -> None:
        """Put everything back as it was when the snapshot was taken."""
        for module, saved in self._attributes:
            current = vars(module)
            for key in [key for key in current if key not in saved]:
                del current[key]
            current.update(saved)
        for container, items in self._contents:  # a module's `_buffers` too: which tensor objects they are
            if isinstance(container, list):
                container[:] = items
            else:
                container.clear()
                container.update(items)
        with torch.no_grad():
            for buf, saved_value in self._buffers:
                buf.copy_(saved_value)
            for tensor, saved_value in self._tensors:
                tensor.copy_(saved_value)
        for p, flag, grad in zip(self._params, self._flags, self._grads, strict=True):
            p.requires_grad_(flag)
            p.grad = grad
        for module, mode in self._modes:
            module.training = mode


@contextmanager
def python_rng_kept() -> Iterator[None]:
    saved = random.getstate()
    try:
        yield
    finally:
        random.setstate(saved)

