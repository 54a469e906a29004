"""What a checkpoint keeps of a fit (`fit_state`) and how a resumed fit takes it back (`restore`).

The checkpoint holds plain data only: the selection in force, the probe window open or pending, the importance
measured so far, the selection history, the wall-clock plan's account and the totals of the summary. Restoring is
tolerant of older checkpoints (a missing key reads as empty) and of a fit that selects among other tensors (only
the account resumes, with a warning).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_elastic.freezing import apply_mask
from lightning_elastic.planner import WallClockPlan
from lightning_elastic.records import Mask, SelectionRecord
from lightning_elastic.session import FitSession

__all__ = ["fit_state", "restore"]


def fit_state(fit: FitSession) -> dict[str, Any]:
    """What a checkpoint keeps of `fit`: plain data (lists, dicts, numbers), read back by `restore`."""
    return {
        "origin": fit.origin,  # read as the resumed fit starts (its schedule counts from it)
        "mask": None if fit.mask is None else list(fit.mask),
        "probe_end": fit.probe_end,
        "ran_on": fit.warmup.ran_on,
        "pending_selection": fit.pending_selection,
        "importance": fit.evaluator.state_dict(),
        **fit.latest.state_dict(),  # "latest", "latest_levels", "level"
        "history": [r.to_dict() for r in fit.history],
        "totals": dict(fit.totals),
        "plan": fit.plan.state_dict(),
        "selected_steps": list(fit.selected_steps),
        "probe_optimizer": list(fit.probe_optimizer),
        "warm_optimizer": list(fit.warmup.updates),
        "warm_full": [fit.warmup.full_seconds, fit.warmup.full_steps],
        "probe_full": list(fit.probe_full),
        "probe_forward": list(fit.probe_forward),
        "forwards": list(fit.forwards),
        "loop_seconds": list(fit.clock.loops),
    }


def restore(fit: FitSession, state: dict[str, Any] | None) -> None:
    """Put a checkpoint's selection, window, importance and account back before the first resumed step; only the
    account when the checkpoint's fit profiled another set of tensors (said: its per-tensor state cannot apply)."""
    if not state:
        return
    saved = len(state.get("latest") or fit.params)
    named = tuple((state.get("profile") or {}).get("names") or fit.names)  # a profile measured again may differ
    if saved != len(fit.params) or named != fit.names:
        rank_zero_warn(
            f"ElasticTensorSelection: the checkpoint's fit selected among {saved} tensors, this fit among "
            f"{len(fit.params)}{', named or ordered otherwise' if saved == len(fit.params) else ''} (`train_never`, "
            "`train_always`, the tensors frozen before the fit or the model changed): its importance, selection and "
            "history are not resumed; its wall-clock account is. Every tensor trains until the next selection, "
            "which uses the importance measured from here."
        )
        state = {k: v for k, v in state.items() if k in ("totals", "plan")}
    mask = state.get("mask")
    if mask is not None and len(mask) == len(fit.params):
        fit.mask = Mask.of(mask)
        apply_mask(fit.params, fit.mask)
    fit.probe_end = state.get("probe_end")
    fit.warmup.ran_on = int(state.get("ran_on", 0))
    fit.pending_selection = bool(state.get("pending_selection", False))
    if state.get("importance") is not None:
        fit.evaluator.load_state_dict(state["importance"])
    if fit.probe_end is not None or fit.pending_selection:
        apply_mask(fit.params, [not f for f in fit.forbidden])  # as the window left them
    latest = state.get("latest")
    if isinstance(latest, list) and len(latest) == len(fit.params):
        fit.latest.load_state_dict(state)
    fit.history = [SelectionRecord.from_dict(r) for r in state.get("history", [])]
    fit.totals.update(state.get("totals", {}))
    # No BatchNorm layer is restored as switched (`bn_frozen`, which older checkpoints hold): modes are not in a
    # checkpoint, so this process's layers are as the user built them, and the policy is applied from those modes.
    fit.selected_steps = [float(s) for s in state.get("selected_steps", [])]
    fit.probe_optimizer = [float(s) for s in state.get("probe_optimizer", [])]
    fit.warmup.updates = [float(s) for s in state.get("warm_optimizer", [])]
    seconds, steps = state.get("warm_full", (0.0, 0))
    fit.warmup.full_seconds, fit.warmup.full_steps = float(seconds), int(steps)
    fit.probe_full = [float(s) for s in state.get("probe_full", [])]
    untimed = [0.0] * len(fit.probe_full)  # a checkpoint from before forward passes were timed
    fit.probe_forward = [float(s) for s in state.get("probe_forward", untimed)]
    fit.forwards = [float(s) for s in state.get("forwards", [])]
    fit.clock.loops = [float(s) for s in state.get("loop_seconds", [])]
    if state.get("plan"):
        restored = WallClockPlan.from_state(state["plan"])
        fit.plan = restored if restored.speedup == fit.plan.speedup else fit.plan
