"""Which profile a fit can use without measuring: the one given, or a checkpoint's or the last fit's while it still
describes the training step (`stale_reason`, on the first batch through `harness.training_step`)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_elastic.profiling.harness import ProfileChoice, training_step
from lightning_elastic.profiling.profile import StaleProfileError, TimingProfile, load_given_profile, mismatch
from lightning_elastic.profiling.runner import fingerprint

__all__ = ["reusable_profile", "stale_reason"]


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

    The last fit's analytic profile is not this fit's when `choice` pays for a measured one (a short "auto" fit,
    then a long one); a measured one serves any choice. A checkpoint's profile is kept whichever method took it: the
    resumed fit goes on with the plan it made with it.
    """
    loaded = load_given_profile(given)
    if loaded is not None:
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


def stale_reason(trainer: L.Trainer, pl_module: L.LightningModule, prof: TimingProfile) -> str | None:
    """Why ``prof`` (a checkpoint's or an earlier fit's) no longer describes ``pl_module``'s training step, or None.

    Checks the parameters (`mismatch`), the kind of device, and the fingerprint of the step as it runs now (one
    forward and backward pass on the first batch): a step whose graph changed (gradient checkpointing turned on, a
    changed functional op, another input shape) costs differently. Rank zero's answer holds on every rank.

    The fingerprint is taken with the tensors the profile covers trainable, as they were when it was measured. A
    covered tensor that is frozen now (a `train_never` one in a checkpoint of a version that profiled before freezing
    them, or one the user froze since) would be left out of a new profile's key, but the time model is the same with
    it in the profile and never selected (docs/time_model.md): the profile still describes the step.
    """
    reason = mismatch(prof, pl_module)
    if reason is None and not prof.device.startswith(pl_module.device.type):
        reason = f"taken on {prof.device}, training runs on {pl_module.device.type}"
    if reason is None:
        with training_step(trainer, pl_module) as compute_loss, _as_profiled(pl_module, prof):
            if fingerprint(pl_module, compute_loss, prof.method) != prof.fingerprint:
                reason = "the training step's fingerprint differs (its graph, its input or the device changed)"
    return reason if trainer.world_size == 1 else trainer.strategy.broadcast(reason, src=0)


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
