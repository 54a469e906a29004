"""Which profile a fit can use without measuring: the one given (said when it was taken of another training step,
`warn_if_other_step`), or a checkpoint's or the last fit's while it still describes the step (`stale_reason`). Both
compare the profile's fingerprint with the step's (`step_difference`, one pass through `harness.training_step`)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_elastic.errors import ElasticConfigError
from lightning_elastic.profiling.cache import device_name
from lightning_elastic.profiling.harness import ProfileChoice, training_step
from lightning_elastic.profiling.profile import StaleProfileError, TimingProfile, load_given_profile, mismatch
from lightning_elastic.profiling.runner import fingerprint

__all__ = ["other_device_kind", "reusable_profile", "stale_reason", "step_difference", "warn_if_other_step"]


def reusable_profile(
    trainer: L.Trainer,
    pl_module: L.LightningModule,
    given: TimingProfile | str | os.PathLike[str] | None,
    restored: Mapping[str, Any] | None,
    previous: TimingProfile | None,
    choice: ProfileChoice,
) -> TimingProfile | None:
    """The given profile; else the checkpoint's (`restored`) or the last fit's, if they describe this module; else
    None (the fit measures one, or reads it from the cache).

    The given profile is used as given; a fit whose training step is not the one it was taken of says so, before
    training (`warn_if_other_step`), and one taken on another kind of device is refused (`ElasticConfigError`). The
    last fit's analytic profile is not this fit's when `choice` pays for a measured one (a short "auto" fit, then a
    long one); a measured one serves any choice. A checkpoint's profile is kept whichever method took it: the resumed
    fit goes on with the plan it made with it.
    """
    loaded = load_given_profile(given)
    if loaded is not None:
        if other_device_kind(loaded, pl_module) is not None:
            raise ElasticConfigError(
                f"`profile` must be taken on the kind of device this fit trains on ({pl_module.device.type}): profile "
                f"the model on it, or leave `profile` unset and the fit profiles it. Found: a profile taken on "
                f"{loaded.device}"
            )
        if mismatch(loaded, pl_module) is None:  # else refused as the fit binds its tensors (`profiled_parameters`)
            warn_if_other_step(trainer, pl_module, loaded)
        return loaded
    for source, candidate in (("checkpoint's", _checkpoint_profile(restored)), ("previous fit's", previous)):
        if candidate is None:
            continue
        if candidate is previous and candidate.method == "flops" and choice.method == "measured":
            rank_zero_info(
                "ElasticTensorSelection: the previous fit's timing profile is analytic (time_model 'flops'); this "
                "fit can pay for a measured one, so it profiles again."
            )
            continue
        reason = stale_reason(trainer, pl_module, candidate)
        if reason is None:
            return candidate
        rank_zero_info(
            f"ElasticTensorSelection: the {source} timing profile does not describe this model ({reason}); "
            "profiling again."
        )
    return None


def _checkpoint_profile(restored: Mapping[str, Any] | None) -> TimingProfile | None:
    """The profile a checkpoint saved; None when it saved none, or one in an older file format (said: the fit
    profiles again)."""
    if not restored:
        return None
    try:
        return TimingProfile.from_dict(restored)
    except StaleProfileError as err:
        rank_zero_info(
            f"ElasticTensorSelection: the checkpoint's timing profile was written in another format ({err}); "
            "profiling again."
        )
        return None


def warn_if_other_step(trainer: L.Trainer, pl_module: L.LightningModule, prof: TimingProfile) -> None:
    """Warn when ``prof``, a profile the user gave, was not taken of this fit's training step (`step_difference`).

    Not a refusal: the user asked for this profile (one taken on another machine of the same kind, built by hand, or
    by `lightning_elastic.profile` with a loss of their own), and a profile of a nearby step still ranks the tensors'
    costs; the step times the fit measures correct the plan's totals, not how the tensors compare.
    """
    difference = _rank_zero(trainer, step_difference(trainer, pl_module, prof))
    if difference is not None:
        rank_zero_warn(
            f"ElasticTensorSelection: the given `profile` does not match this fit's training step ({difference}). It "
            "is used as given: its times may be off for this step; the step times the fit measures correct the "
            "plan's totals, not how the tensors' costs compare. Leave `profile` unset to profile this step (or read "
            "its cached profile)."
        )


def stale_reason(trainer: L.Trainer, pl_module: L.LightningModule, prof: TimingProfile) -> str | None:
    """Why ``prof`` (a checkpoint's or an earlier fit's) no longer describes ``pl_module``'s training step, or None.

    Checks the parameters (`mismatch`), the kind of device, and the fingerprint of the step as it runs now
    (`step_difference`): a step whose graph changed (gradient checkpointing turned on, a changed functional op,
    another input shape) costs differently. Rank zero's answer holds on every rank.
    """
    reason = mismatch(prof, pl_module)
    if reason is None:
        reason = other_device_kind(prof, pl_module)
    if reason is None:
        reason = step_difference(trainer, pl_module, prof)
    return _rank_zero(trainer, reason)


def other_device_kind(prof: TimingProfile, pl_module: L.LightningModule) -> str | None:
    """Why ``prof`` was taken on another kind of device than ``pl_module`` trains on (a GPU's per-tensor costs say
    nothing of a CPU's, nor the reverse), or None."""
    if prof.device.startswith(pl_module.device.type):
        return None
    return f"taken on {prof.device}, training runs on {pl_module.device.type}"


def step_difference(trainer: L.Trainer, pl_module: L.LightningModule, prof: TimingProfile) -> str | None:
    """What differs between the step ``prof`` was taken of and ``pl_module``'s training step now, or None when its
    fingerprint is this step's (one forward and backward pass on the first batch, the module left as it was): this
    process's answer.

    The fingerprint covers the device, the torch version, the parameters' names, shapes and dtypes, and the step's
    module calls with their inputs' shapes and dtypes and its autograd graph (`graph.StepSignature`). Of those the
    profile records the device, named when it differs, and the parameters' names and shapes (`mismatch`'s to check,
    first); anything else is the step's.

    The fingerprint is taken with the tensors the profile covers trainable, as they were when it was measured. A
    covered tensor that is frozen now (a `train_never` one in a checkpoint of a version that profiled before freezing
    them, or one the user froze since) would be left out of a new profile's key, but the time model is the same with
    it in the profile and never selected (docs/time_model.md): the profile still describes the step.
    """
    with training_step(trainer, pl_module) as compute_loss, _as_profiled(pl_module, prof):
        if fingerprint(pl_module, compute_loss, prof.method) == prof.fingerprint:
            return None
    if prof.device != (now := device_name(pl_module.device)):
        return f"it was taken on {prof.device}, this fit runs on {now}"
    return (
        "it was taken of another training step: its graph, the shapes or dtypes of its inputs or parameters, or the "
        "torch version differ"
    )


def _rank_zero(trainer: L.Trainer, value: str | None) -> str | None:
    """Rank zero's `value` on every rank (a collective under DDP: every rank calls it)."""
    return value if trainer.world_size == 1 else trainer.strategy.broadcast(value, src=0)


@contextmanager
def _as_profiled(pl_module: L.LightningModule, prof: TimingProfile) -> Iterator[None]:
    """The tensors `prof` covers that are frozen now made trainable while the block runs, then frozen again."""
    covered = set(prof.names) | set(prof.unused)
    thawed = [p for name, p in pl_module.named_parameters() if name in covered and not p.requires_grad]
    for param in thawed:
        param.requires_grad_(True)
    try:
        yield
    finally:
        for param in thawed:
            param.requires_grad_(False)
