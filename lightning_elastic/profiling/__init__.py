"""Per-device tensor timing profiler and the time model that the tensor selector optimises.

For every parameter tensor ``i`` (in forward order, index 0 nearest the input) a `TimingProfile` holds

* ``t_dw[i]``: the time to compute tensor ``i``'s own gradient (its share of the weight-gradient kernel
  and of the ``AccumulateGrad`` step);
* ``t_dy[i]``: the time to propagate the output gradient through the op that owns tensor ``i`` down to
  that op's input, plus the parameter-free ops between it and the previous tensor's op, plus the extra
  forward work of recording the autograd graph for those ops;

and predicts the time of one forward+backward pass in which only the tensors of a ``mask`` require grad:
``t_fixed + sum_k mask[k] * t_dw[k] + sum_{i > d} t_dy[i]`` with ``d`` the lowest selected index.

How ``profile(method="measured")`` measures, on the device the model is on:

1. Every backward node is timed by autograd node hooks (``Node.register_prehook`` / ``register_hook``,
   CUDA events on GPU). Each node gets a *level*: the highest forward index among the parameters that
   its gradient inputs depend on. A node is run iff the deepest selected tensor ``d`` is at most its
   level, so the model is exact for "everything above ``d``" selections, also with skip connections and
   attention (other selections are charged as if the ops above ``d`` all ran).
2. Weight-gradient work is separated from input-gradient work by a second pass with the parameters
   frozen and the inputs of the first parametrised modules turned into leaves that require grad, so
   every input-gradient path still runs; nodes are matched between the passes by position.
3. Forward ops are timed with a ``TorchFunctionMode`` with and without graph recording: a frozen
   prefix records no graph and is cheaper, and that saving is charged to the ``t_dy`` of the prefix.
4. Hooks cost time, so the hook-derived costs are scaled by one factor to a plain, hook-free full step (in a fit on
   CPU, the fit's first step's backward pass and one plain forward), as the analytic ones are.

``method="flops"`` replaces the hooks with an analytic count of each op's backward work (see
`lightning_elastic.profiling.flops`), scaled so that the full step matches one plain measured step (in a fit on CPU,
the fit's first step's backward pass and one plain forward).

Modules: `profile` (the `TimingProfile` type and its one JSON reader/writer), `cache` (the per-user cache: where, its
key, its entries), `runner` (`profile` itself: its arguments, the model left as found), `passes` (the passes of one
profile and the two methods that combine them), `graph` (recording and walking the autograd graph), `attribution` (node
times to tensors, aligning graphs that differ), `calibration` (the plain timings a profile is scaled to), `flops`
(analytic op costs), `state` (what profiling must leave as it found), `harness` (the first training batch to the
loss, as Lightning's own step computes it), `first_step` (the fit's first step recorded as the profile's first pass),
`reuse` (which profile a fit can use without measuring).
"""

from lightning_elastic.profiling.profile import TimeModel, TimingMethod, TimingProfile
from lightning_elastic.profiling.runner import profile

__all__ = ["TimeModel", "TimingMethod", "TimingProfile", "profile"]
