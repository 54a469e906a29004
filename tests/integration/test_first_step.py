"""The fit's first training step is the profile's fingerprint pass (`first_step.FirstStep`): nothing else changes."""

from __future__ import annotations

import gc
import itertools
import logging
import math
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import Tensor, nn
from torch.utils.data import DataLoader
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAUROC

from lightning_elastic import ElasticTensorSelection, warmup, windows
from lightning_elastic.errors import ElasticConfigError
from lightning_elastic.profiling import TimingProfile, first_step, runner
from lightning_elastic.profiling.first_step import FirstStep
from lightning_elastic.profiling.passes import FIRST_BACKWARD_MAX
from lightning_elastic.profiling.runner import Runner
from lightning_elastic.timing import DeviceClock
from tests.integration.test_callback import Recorder
from tests.integration.tiny import TinyNet, tiny_data, tiny_trainer

# Every test here profiles for real: on the profiler's ticking clock, whose timings follow the step's ops.
pytestmark = pytest.mark.usefixtures("ticking_profiler")


class Counted(TinyNet):
    """Counts `training_step` calls (Lightning's and the profiler's), with dropout and a metric updated each call."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net.insert(3, nn.Dropout(0.2))
        # the batch_idx of every call, the profiler's too: kept one level down, which profiling does not give back
        # (it gives plain attributes their values, and lists, dicts and sets their items)
        self.log_of_calls = SimpleNamespace(called=[])
        self.mean_loss = MeanMetric()

    @property
    def calls(self) -> int:
        return len(self.called)

    @property
    def called(self) -> list[int]:
        return self.log_of_calls.called  # type: ignore[no-any-return]

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        self.called.append(batch_idx)
        loss = super().training_step(batch, batch_idx)
        self.mean_loss.update(loss.detach())
        return loss


def elastic(cache_dir: Path | bool, **kwargs: Any) -> ElasticTensorSelection:
    # 1.001 on the ticking clock: in reach however busy the machine (the point is where profiling runs, not the budget)
    settings: dict[str, Any] = dict(speedup=1.001, probe_steps=2, interval=1, calibrate=False, cache_dir=cache_dir)
    settings.update(kwargs)
    return ElasticTensorSelection(**settings)


def test_profiling_takes_no_fingerprint_pass_and_a_cached_profile_costs_no_pass_at_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """... and a fit that reads its profile from the cache says so alone, not that it profiles."""
    signatures: list[int] = []
    own_pass = Runner.signature
    monkeypatch.setattr(Runner, "signature", lambda self: signatures.append(1) or own_pass(self))
    first, timing = Counted(), elastic(tmp_path)
    with caplog.at_level(logging.INFO):
        tiny_trainer(callbacks=[timing], max_steps=8).fit(first, tiny_data())
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ElasticTensorSelection: ")]
    assert said[0].startswith("ElasticTensorSelection: profiling 10 tensors after the first training step's backward")
    assert "kept in the cache for later fits that profile this model on this device the same way" in said[0]
    assert [line.split(": ", 2)[1] for line in said[1:4]] == [f"profiling, phase {k} of 3" for k in (1, 2, 3)]
    assert " tensors profiled on cpu" in said[4]
    caplog.clear()
    assert signatures == []  # the first step's own pass was the fingerprint's
    assert first.calls > 8  # 8 steps and the profile's passes
    assert timing._fit is not None and not timing._fit.warmup.cold  # its timing passes warmed the process up
    again = Counted()
    callback = elastic(tmp_path)
    with caplog.at_level(logging.INFO):
        tiny_trainer(callbacks=[callback], max_steps=8).fit(again, tiny_data())
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ElasticTensorSelection: ")]
    assert said[0].startswith("ElasticTensorSelection: 10 tensors profiled earlier (a profile read, not timed")
    assert not any(line.startswith("ElasticTensorSelection: profiling") for line in said)  # no opening, no phase
    assert again.calls == 8  # the cache was found with the first step's fingerprint: no pass of profiling
    assert signatures == []
    assert callback.timing_profile is not None and callback.timing_profile.profile_seconds > 0  # read, not measured
    assert callback._fit is not None and callback._fit.warmup.cold  # no timing pass: its first window may run on
    assert len(list(tmp_path.glob("timing-*.json"))) == 1


def test_a_fit_without_a_cache_says_it_profiles_and_nothing_of_a_cache(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        tiny_trainer(callbacks=[elastic(False)], max_steps=8).fit(Counted(), tiny_data())
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ElasticTensorSelection: profiling")]
    assert said[0].startswith("ElasticTensorSelection: profiling 10 tensors after the first training step's backward")
    assert "cache" not in said[0] and len(said) == 4  # the opening, then phases 1-3


def test_auto_profiles_a_short_fit_analytically_says_why_and_takes_a_cached_measured_profile_first(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`time_model="auto"`: an 8-step fit cannot pay for a measured profile (about 6 steps), a long one can."""
    short = elastic(tmp_path)
    with caplog.at_level(logging.INFO):
        tiny_trainer(callbacks=[short], max_steps=8).fit(Counted(), tiny_data())
    assert short.timing_profile is not None and short.timing_profile.method == "flops"
    assert "analytic time model" in caplog.text and "time_model='auto': a measured profile" in caplog.text
    measured = elastic(tmp_path, time_model="measured")  # an explicit choice holds in a short fit
    tiny_trainer(callbacks=[measured], max_steps=8).fit(Counted(), tiny_data())
    assert measured.timing_profile is not None and measured.timing_profile.method == "measured"
    again, model = elastic(tmp_path), Counted()
    tiny_trainer(callbacks=[again], max_steps=8).fit(model, tiny_data())
    assert again.timing_profile is not None and again.timing_profile.method == "measured"  # not the flops one
    assert again.timing_profile.fingerprint == measured.timing_profile.fingerprint
    assert model.calls == 8  # read from the cache: no pass of profiling
    # 0.8 of an 8-step fit's 7.99 planned full steps: the 6 a measured profile costs when the fit's first step is its
    # first pass fit in it, the 7 it costs when profiling takes a pass of its own would not
    monkeypatch.setattr(windows, "OWN_SHARE", 0.8)
    long = elastic(tmp_path / "empty")
    tiny_trainer(callbacks=[long], max_steps=8).fit(Counted(), tiny_data())
    assert long.timing_profile is not None and long.timing_profile.method == "measured"
    assert long._choice == ("measured", True, True, True)  # on CPU: the first backward is the step's


def test_a_second_fit_that_can_pay_for_a_measured_profile_does_not_keep_the_first_fits_analytic_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One callback, a short fit (analytic profile), then one that can pay for a measured profile: it measures one,
    and says why; a third, short again, keeps that measured profile and profiles no more."""
    callback = elastic(tmp_path)
    tiny_trainer(callbacks=[callback], max_steps=8).fit(Counted(), tiny_data())
    assert callback.timing_profile is not None and callback.timing_profile.method == "flops"
    share = windows.OWN_SHARE
    monkeypatch.setattr(windows, "OWN_SHARE", 1.0)  # 6 steps of an 8-step fit: affordable now
    with caplog.at_level(logging.INFO):
        tiny_trainer(callbacks=[callback], max_steps=8).fit(Counted(), tiny_data())
    assert callback.timing_profile is not None and callback.timing_profile.method == "measured"
    assert "the previous fit's timing profile is analytic (time_model 'flops')" in caplog.text
    monkeypatch.setattr(windows, "OWN_SHARE", share)
    third = Counted()
    tiny_trainer(callbacks=[callback], max_steps=8).fit(third, tiny_data())
    assert callback.timing_profile.method == "measured"  # a measured profile serves a fit of any length
    assert third.calls == 8 + 1  # and costs no profiling: only the stale check's fingerprint pass


@pytest.mark.parametrize("tick", [3e-3, 7e-3])
def test_the_analytic_profile_takes_the_first_steps_backward_pass_as_its_full_steps(
    tick: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fit's first step is the analytic profile's timed full step too: its backward pass, timed on a clock of its
    own here (3 ms a reading: the two readings around it are 3 ms apart), and one plain forward pass with nothing
    selected (1 ms on the profiler's clock); no full step of the profile's own, and no op-counting pass: the step's
    forward pass counted its ops. A backward pass of 7 ms, more than `FIRST_BACKWARD_MAX` forwards, is a process
    still warming up: the profile times a full step between two plain forwards, as a fit that profiles as training
    starts (plain SGD), which has no step of its own yet, does after its counting pass."""
    masks: list[list[bool]] = []
    own = Runner.plain
    monkeypatch.setattr(Runner, "plain", lambda self, mask: masks.append(list(mask)) or own(self, mask))
    ticks = itertools.count()
    monkeypatch.setattr(first_step, "DeviceClock", lambda device, clock: DeviceClock(device, lambda: next(ticks) * tick))
    callback, module = elastic(False, time_model="flops"), Counted()
    tiny_trainer(callbacks=[callback], max_steps=4).fit(module, tiny_data())
    prof = callback.timing_profile
    assert prof is not None and prof.method == "flops" and prof.t_fw == pytest.approx(1e-3, abs=1e-12)
    if tick * 1e3 <= FIRST_BACKWARD_MAX:
        assert masks == [[False] * len(prof.names)] and module.calls == 4 + 1  # the plain forward, nothing else
        assert prof.t_full - prof.t_fw == pytest.approx(tick, abs=1e-12)
    else:
        assert [all(m) for m in masks] == [False, False, True, False] and prof.t_full != prof.t_fw + tick
        assert module.calls == 4 + len(masks)
    masks.clear()  # profiling as training starts (plain SGD): no step ran, so the profile times a full step itself
    plain = Counted()
    plain.configure_optimizers = lambda: torch.optim.SGD(plain.parameters(), lr=0.05)  # type: ignore[method-assign]
    again = elastic(False, time_model="flops")
    tiny_trainer(callbacks=[again], max_steps=4).fit(plain, tiny_data())
    assert [all(m) for m in masks] == [False, True, False]
    assert plain.calls == 4 + 1 + 1 + len(masks)  # the steps, the fingerprint's pass, the counting pass, the timings'
    assert again.timing_profile is not None and again.timing_profile.names == prof.names
    assert shares(again.timing_profile) == pytest.approx(shares(prof), rel=1e-9)  # the same ops counted


def shares(prof: TimingProfile) -> list[float]:
    """Each tensor's terms as shares of them all: what op counts alone decide (a profile's seconds scale them). The
    tail (work paid whatever is trained) is left out: the step's own `self.log` of its loss adds a scalar op to it,
    which profiling's passes, muted, do not run."""
    total = sum(prof.t_dw) + sum(prof.t_dy)
    return [v / total for v in (*prof.t_dw, *prof.t_dy)]


def test_the_first_step_trains_as_it_would_without_the_callback() -> None:
    """Profiling between its backward pass and its update leaves the update, BatchNorm, dropout and metrics alone."""
    results = []
    for callbacks in ([], [elastic(False)]):
        torch.manual_seed(1)
        module = Counted()
        tiny_trainer(callbacks=callbacks, max_steps=1).fit(module, tiny_data())
        results.append((module, [t.detach().clone() for t in [*module.parameters(), *module.buffers()]]))
    (plain, expected), (profiled, got) = results
    assert profiled.calls > plain.calls == 1
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)
    assert profiled.mean_loss.update_count == plain.mean_loss.update_count == 1
    assert torch.equal(profiled.mean_loss.compute(), plain.mean_loss.compute())


def test_every_step_is_in_the_account_and_the_first_is_a_probe_step() -> None:
    callback = elastic(False)
    counts: list[list[int]] = []

    class AfterFirstStep(Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == 1 and callback._fit is not None:
                counts.append(list(callback._fit.evaluator.counts))

    tiny_trainer(callbacks=[callback, AfterFirstStep()], max_steps=8).fit(Counted(), tiny_data())
    fit = callback._fit
    assert fit is not None
    assert fit.plan.steps_done == 8
    assert fit.totals["warmup_seconds"] > 0  # the first step: charged, never a sample of `T`
    assert fit.history[0].step == 2  # after the probe window of steps 0 and 1
    assert counts == [[1] * len(fit.params)]  # the first step's update measured every tensor's importance


def test_out_of_reach_is_refused_before_any_parameter_changes() -> None:
    torch.manual_seed(0)
    module = Counted()
    before = [p.detach().clone() for p in module.parameters()]
    updates: list[int] = []

    class Updates(Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            updates.append(trainer.global_step)

    with pytest.raises(ElasticConfigError, match=r"`speedup` must be at most .* Found: 50.0"):
        tiny_trainer(callbacks=[elastic(False, speedup=50.0, calibrate=True), Updates()], max_steps=8).fit(
            module, tiny_data()
        )
    assert updates == []
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))
    assert all(p.requires_grad for p in module.parameters())


def test_with_gradient_accumulation_the_fingerprint_is_the_profilers_own() -> None:
    """Lightning divides the loss by the step's micro-batches; the signature starts below that division, so the
    next fit's check (the profiler's own pass) finds the same step and keeps the profile."""
    module = Counted()
    callback = elastic(False)
    tiny_trainer(callbacks=[callback], max_steps=3, accumulate_grad_batches=2).fit(module, tiny_data())
    first = callback.timing_profile
    tiny_trainer(callbacks=[callback], max_steps=3, accumulate_grad_batches=2).fit(module, tiny_data())
    assert first is not None and callback.timing_profile is first


def test_a_first_step_that_skips_its_backward_pass_leaves_profiling_to_the_next() -> None:
    class SkipsFirst(Counted):
        def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor | None:
            loss = super().training_step(batch, batch_idx)
            return None if self.calls == 1 else loss

    callback = elastic(False)
    trainer = tiny_trainer(callbacks=[callback], max_steps=6)
    trainer.fit(SkipsFirst(), tiny_data())
    assert callback.timing_profile is not None
    assert callback._fit is not None and len(callback.history) >= 1


def test_a_training_step_that_skips_batch_0_is_profiled_on_the_branch_its_first_step_took() -> None:
    class SkipsBatch0(Counted):
        def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor | None:
            loss = super().training_step(batch, batch_idx)
            return None if batch_idx == 0 else loss

    callback, module = elastic(False), SkipsBatch0()
    tiny_trainer(callbacks=[callback], max_steps=6).fit(module, tiny_data())
    assert callback.timing_profile is not None and len(callback.history) >= 1
    profiled = module.called[1 : module.called.index(2)]  # the first step's (batch 1) and the profiler's calls
    assert len(profiled) > 1 and set(profiled) == {1}


def test_what_training_step_collects_for_the_epochs_end_is_what_it_collects_without_the_callback() -> None:
    """Profiling calls `training_step` again on the first step's batch: the outputs it appends to a list and the
    list states of a metric (AUROC without thresholds keeps every batch) must not keep those calls' batches."""

    class Collecting(TinyNet):
        def __init__(self) -> None:
            super().__init__()
            self.outputs: list[Tensor] = []
            self.auroc = MulticlassAUROC(num_classes=3, thresholds=None)
            self.per_epoch: list[tuple[int, int]] = []

        def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
            x, y = batch
            logits = self(x)
            self.outputs.append(logits.detach())
            self.auroc.update(logits.softmax(-1), y)
            return F.cross_entropy(logits, y)

        def on_train_epoch_end(self) -> None:
            self.per_epoch.append((len(self.outputs), sum(len(p) for p in self.auroc.preds)))
            self.outputs.clear()
            self.auroc.reset()

    plain, collecting = Collecting(), Collecting()
    tiny_trainer(max_epochs=2).fit(plain, tiny_data())
    tiny_trainer(callbacks=[elastic(False, time_model="measured")], max_epochs=2).fit(collecting, tiny_data())
    assert collecting.per_epoch == plain.per_epoch == [(8, 256), (8, 256)]


NEVER = ("net.0.weight", "net.0.bias")
USER_FROZEN = "net.6.bias"


def counted_with_a_frozen_tensor() -> Counted:
    module = Counted()
    module.net[6].bias.requires_grad_(False)  # frozen by the user: given back frozen
    return module


def flags(module: nn.Module) -> dict[str, bool]:
    return {name: p.requires_grad for name, p in module.named_parameters()}


def as_the_user_had_them(module: nn.Module) -> dict[str, bool]:
    return {name: name != USER_FROZEN for name, _ in module.named_parameters()}


def test_train_never_is_frozen_before_the_first_step_which_profiles_without_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first step trains every tensor but the `train_never` ones, and is still the fingerprint's pass; the
    profile covers the tensors it trained; the user's flags come back; a second run reads the cache."""
    signatures: list[int] = []
    own_pass = Runner.signature
    monkeypatch.setattr(Runner, "signature", lambda self: signatures.append(1) or own_pass(self))
    callback, recorder = elastic(tmp_path, train_never=["net.0.*"]), Recorder()
    module = counted_with_a_frozen_tensor()
    names = [n for n, _ in module.named_parameters()]
    tiny_trainer(callbacks=[callback, recorder], max_steps=8).fit(module, tiny_data())
    assert signatures == []  # no fingerprint pass: the first step's own
    assert recorder.steps == list(range(8))
    trained_at_first_step = [n not in NEVER and n != USER_FROZEN for n in names]
    assert list(recorder.trainable[0]) == trained_at_first_step
    assert list(recorder.changed[0]) == trained_at_first_step  # step 0's update moved exactly those
    never = [names.index(n) for n in NEVER]
    assert not any(step[k] for step in recorder.trainable + recorder.changed for k in never)  # at no step
    profile = callback.timing_profile
    assert profile is not None and set(profile.names) == {n for n, t in zip(names, trained_at_first_step, strict=True) if t}
    assert callback._fit is not None and not any(callback._fit.forbidden)  # nothing else to forbid
    assert flags(module) == as_the_user_had_them(module)
    assert len(list(tmp_path.glob("timing-*.json"))) == 1

    again, cached = counted_with_a_frozen_tensor(), elastic(tmp_path, train_never=["net.0.*"])
    tiny_trainer(callbacks=[cached], max_steps=8).fit(again, tiny_data())
    assert again.calls == 8 and signatures == []  # the cache was hit with the first step's fingerprint
    # the same profile, with the steady step the first fit's window timed after its one warm-up step remembered in it
    assert cached.timing_profile is not None and cached.timing_profile.t_step > 0 == profile.t_step
    remembered = cached.timing_profile.t_step, cached.timing_profile.t_update  # and that step's optimizer update
    assert 0 < remembered[1] < remembered[0]
    assert cached.timing_profile == replace(profile, t_step=remembered[0], t_update=remembered[1])
    assert flags(again) == as_the_user_had_them(again)


def test_a_second_fit_with_train_never_keeps_the_profile_of_the_first() -> None:
    """The second fit's stale check runs the profiler's own fingerprint pass with the `train_never` tensors frozen
    again, as the first step ran: it finds the same step and keeps the profile."""
    callback, module = elastic(False, train_never=["net.0.*"]), counted_with_a_frozen_tensor()
    tiny_trainer(callbacks=[callback], max_steps=4).fit(module, tiny_data())
    first = callback.timing_profile
    calls = module.calls
    tiny_trainer(callbacks=[callback], max_steps=4).fit(module, tiny_data())
    assert first is not None and callback.timing_profile is first
    assert module.calls == calls + 4 + 1  # four steps and the stale check's one pass: nothing profiled again
    assert flags(module) == as_the_user_had_them(module)


def test_train_never_patterns_are_checked_before_the_first_step() -> None:
    module = Counted()
    before = [p.detach().clone() for p in module.parameters()]
    with pytest.raises(ElasticConfigError, match=r"`train_never` patterns must each match .* Found patterns matching "
                       r"nothing: \['nett\.\*'\]"):
        tiny_trainer(callbacks=[elastic(False, train_never=["nett.*"])], max_steps=4).fit(module, tiny_data())
    assert module.calls == 0
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))
    with pytest.raises(ElasticConfigError, match=r"`train_always` must not name tensors that `train_never` names"):
        tiny_trainer(
            callbacks=[elastic(False, train_always=["net.0.bias"], train_never=["net.0.*"])], max_steps=4
        ).fit(module, tiny_data())
    assert all(p.requires_grad for p in module.parameters())


def test_a_scaled_mixed_precision_loss_keys_the_same_step_as_the_profilers_own_pass() -> None:
    """A GradScaler multiplies the loss Lightning differentiates; the key comes from what `training_step` returned."""
    scaler = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    module, callback = Counted(), elastic(False)
    tiny_trainer(callbacks=[callback], max_steps=3, plugins=[scaler]).fit(module, tiny_data())
    first = callback.timing_profile
    tiny_trainer(callbacks=[callback], max_steps=3, plugins=[scaler]).fit(module, tiny_data())
    assert first is not None and callback.timing_profile is first


def test_ddp_on_one_device_profiles_as_training_starts() -> None:
    """DDP's wrapper adds its own node to the step's graph: only the single-device strategy profiles in the step."""
    module = Counted()
    assert FirstStep.applies(tiny_trainer(), module)
    assert not FirstStep.applies(tiny_trainer(strategy="ddp", devices=1), module)


def test_first_steps_that_skip_their_backward_pass_still_leave_a_probe_window_and_every_step_counted() -> None:
    class SkipsTwo(Counted):
        def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor | None:
            loss = super().training_step(batch, batch_idx)
            return None if self.trainer.global_step < 2 and self.calls <= 2 else loss

    callback = elastic(False)
    trainer = tiny_trainer(callbacks=[callback], max_steps=16)  # two epochs of 8 steps
    trainer.fit(SkipsTwo(), tiny_data())
    fit = callback._fit
    assert fit is not None and fit.plan.steps_done == trainer.global_step == 16
    # the first window (steps 0-1) was skipped: one opens at step 2, and its selection comes as epoch 1 starts
    assert [r.step for r in callback.history] == [8]
    # every step from step 2 was timed; the window from step 2 is the process's warm-up (`warmup.WARMUP_STEPS`),
    # so `T`'s samples are the window before step 8 (one of its two steps, if the other took twice as long)
    assert fit.steps_timed == 14 and warmup.WARMUP_STEPS >= 2
    assert 1 <= fit.plan.full_samples <= 2


def test_a_first_window_that_opens_late_is_as_long_as_the_scheduled_first_window() -> None:
    """The first 6 steps return no loss, so profiling and the first window begin at step 6, after the scheduled
    first window (auto: 6 steps, to time 2 steady full steps after the process's warm-up; 3 once the analytic profile
    this fit asks for is timed, which warms the process up for all but its first step): the window opened there
    is that long too (before, a later window's length, all of it warm-up), and its selection waits for the epoch."""

    class SkipsSix(Counted):
        def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor | None:
            loss = super().training_step(batch, batch_idx)
            return None if self.trainer.global_step < 6 and self.calls <= 6 else loss

    callback = elastic(False, probe_steps="auto", interval=2, time_model="flops")
    trainer = tiny_trainer(callbacks=[callback], max_steps=64, max_epochs=8)  # epochs of 8 steps, selections every 16
    trainer.fit(SkipsSix(), tiny_data())
    fit = callback._fit
    assert fit is not None and fit.warmup.timed == "flops"
    assert fit.schedule.first_steps == warmup.PROFILED_WARMUP_STEPS + warmup.FIRST_STEADY_STEPS == 3
    assert [r.step for r in callback.history][:1] == [16]
    # every step from 6 timed; 3 of them probe steps: the first window's, the schedule opening no other in this fit
    assert fit.steps_timed == 58 and fit.totals["probe_steps"] == 3 and fit.schedule.probe_every >= 4


def test_a_failing_call_after_the_fit_does_not_give_back_the_fits_flags() -> None:
    module, callback = Counted(), elastic(False)
    trainer = tiny_trainer(callbacks=[callback], max_steps=3)
    trainer.fit(module, tiny_data())
    module.net[0].weight.requires_grad_(False)  # the user freezes a tensor after the fit

    class Fails(Callback):
        def on_fit_start(self, *args: Any) -> None:
            raise RuntimeError("the next fit fails before training starts")

    with pytest.raises(RuntimeError, match="the next fit fails"):
        tiny_trainer(callbacks=[callback, Fails()], max_steps=3).fit(module, tiny_data())
    assert not module.net[0].weight.requires_grad


class Padded(L.LightningModule):
    """Token sequences padded to the longest in their batch: every module input's shape changes from batch to batch.
    Keeps the sequence length of every `training_step` call (the first is the fit's first step)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(40, 16)
        self.mix = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)
        self.lengths: list[int] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        tokens, labels = batch
        self.lengths.append(tokens.shape[1])
        return F.cross_entropy(self.head(torch.relu(self.mix(self.embed(tokens))).mean(1)), labels)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)  # momentum: profiled in the first step


def padded_data(seed: int) -> DataLoader[Any]:
    """64 sequences of 1 to 23 tokens, shuffled by `seed`, in batches of 4 padded to the longest."""
    generator = torch.Generator().manual_seed(100)
    samples = [
        (torch.randint(1, 40, (1 + (7 * i) % 23,), generator=generator), torch.tensor(i % 3)) for i in range(64)
    ]

    def collate(items: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        tokens = nn.utils.rnn.pad_sequence([t for t, _ in items], batch_first=True)
        return tokens, torch.stack([y for _, y in items])

    shuffle = torch.Generator().manual_seed(seed)
    return DataLoader(samples, batch_size=4, shuffle=True, generator=shuffle, collate_fn=collate)  # type: ignore[arg-type]


def test_inputs_whose_shapes_vary_per_batch_key_the_cache_reproducibly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two fits shuffled by different seeds start on batches of different lengths: the second still finds the
    first's profile in the cache (the key is the deterministic first batch's, not the shuffled one's)."""
    runs: list[int] = []
    own_run = Runner.run
    monkeypatch.setattr(Runner, "run", lambda self, *args: runs.append(1) or own_run(self, *args))
    first, second = Padded(), Padded()
    tiny_trainer(callbacks=[elastic(tmp_path)], max_steps=4).fit(first, padded_data(seed=1))
    callback = elastic(tmp_path)
    tiny_trainer(callbacks=[callback], max_steps=4).fit(second, padded_data(seed=2))
    assert first.lengths[0] != second.lengths[0]  # the first steps' batches differ in shape
    assert runs == [1]  # profiled once: the second fit read the cache
    assert len(list(tmp_path.glob("timing-*.json"))) == 1
    assert callback.timing_profile is not None


class SkipsFirstEpoch(Counted):
    """Skips the rest of epoch 0 at its first batch (`on_train_batch_start` returns -1); counts the forward
    pre-hooks on its modules, and whether `training_step` is wrapped, in every validation step."""

    def __init__(self) -> None:
        super().__init__()
        self.seen_in_validation: list[tuple[int, bool]] = []

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        return -1 if self.current_epoch == 0 else None

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        hooks = sum(len(m._forward_pre_hooks) for m in self.modules())
        self.seen_in_validation.append((hooks, "training_step" in vars(self)))


def recording(module: nn.Module) -> tuple[int, bool]:
    return sum(len(m._forward_pre_hooks) for m in module.modules()), "training_step" in vars(module)


def test_a_first_step_skipped_by_on_train_batch_start_leaves_no_recording_behind() -> None:
    """-1 from `on_train_batch_start` ends the epoch before its first step runs: the recording started for that step
    ends with the epoch, so no hook is left (nor seen by a validation), and the next epoch's first step is recorded
    afresh, on its own batch."""
    at_epoch_end: list[tuple[int, bool]] = []

    class Watch(Callback):
        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            at_epoch_end.append(recording(pl_module))

    module, callback = SkipsFirstEpoch(), elastic(False)
    trainer = tiny_trainer(callbacks=[callback, Watch()], max_epochs=1)
    trainer.fit(module, tiny_data())
    assert trainer.global_step == 0 and callback.timing_profile is None
    assert at_epoch_end == [(0, False)]
    trainer.validate(module, tiny_data(), verbose=False)
    assert module.seen_in_validation and set(module.seen_in_validation) == {(0, False)}

    module, callback = SkipsFirstEpoch(), elastic(False)
    profiled_on_its_own_batch: list[bool] = []

    class Batches(Callback):
        """Listed before the elastic callback: sees its first step as it is about to profile."""

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.batch = batch

        def on_before_optimizer_step(self, *args: Any) -> None:
            if callback._first is not None:
                profiled_on_its_own_batch.append(callback._first.batch is self.batch)

    at_epoch_end.clear()
    tiny_trainer(callbacks=[Batches(), callback, Watch()], max_epochs=2).fit(module, tiny_data())
    assert at_epoch_end == [(0, False), (0, False)]
    assert profiled_on_its_own_batch == [True]
    assert callback.timing_profile is not None and callback.history
    assert recording(module) == (0, False)


class SlowValidation(Counted):
    """Its own clock: each training step (Lightning's or the profiler's) takes 1 s, each validation batch 100 s, and
    its first training step returns None (no backward pass, no update)."""

    def __init__(self) -> None:
        super().__init__()
        self.now = [0.0]

    def clock(self) -> float:
        return self.now[0]

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor | None:
        self.now[0] += 1.0
        loss = super().training_step(batch, batch_idx)
        return None if self.calls == 1 else loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.now[0] += 100.0


@pytest.mark.parametrize(
    "when",
    [
        pytest.param(dict(val_check_interval=1), id="validation after the skipped step"),
        pytest.param(dict(limit_train_batches=1, max_epochs=5), id="validation at the end of its epoch"),
    ],
)
def test_validation_after_a_skipped_first_step_is_not_charged_to_the_first_step(when: dict[str, Any]) -> None:
    """The first step's seconds are those of its own training step and of the skipped one before it (2 s of the
    module's clock), not the 100 s of a validation run between them, as no other step's are. Before: 102 s. (Only
    the first step warms up after a profile timed in the process, so that the warm-up seconds are exactly its own.)"""
    module = SlowValidation()
    callback = elastic(False, clock=module.clock, interval=4, interval_unit="step")
    trainer = tiny_trainer(callbacks=[callback], max_steps=4, limit_val_batches=1, **when)
    trainer.fit(module, tiny_data(), tiny_data())
    fit = callback._fit
    assert fit is not None and trainer.global_step == 4 and module.now[0] > 400  # validation ran (5 times)
    assert fit.totals["warmup_seconds"] == 2.0


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_plain_sgd_profiles_before_the_first_step_so_that_no_gradients_are_held_meanwhile(
    momentum: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Profiling inside the first step holds its gradients for the update; plain SGD keeps no state that outweighs
    them, so its fit profiles as training starts, with nothing held, and with momentum in the step (docs/memory.md)."""

    class Plain(Counted):
        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=momentum)

    held: list[int] = []  # bytes of gradients alive as each profiling starts
    original = runner.ModelState.__init__

    def recorded(self: Any, model: nn.Module) -> None:
        held.append(sum(p.grad.nbytes for p in model.parameters() if p.grad is not None))
        original(self, model)

    monkeypatch.setattr(runner.ModelState, "__init__", recorded)
    module = Plain()
    tiny_trainer(callbacks=[elastic(False)], max_steps=4).fit(module, tiny_data())
    assert held
    if momentum == 0:
        assert held == [0] * len(held)
    else:
        assert held[0] == sum(p.nbytes for p in module.parameters())  # every tensor's gradient, for the update


@pytest.mark.parametrize("time_model", ["measured", "flops"])
@pytest.mark.parametrize("momentum", [None, 0.0])  # Adam: profiled in the first step; plain SGD: as training starts
def test_the_profilers_passes_run_with_the_garbage_collector_held_off_and_the_fits_steps_with_it_on(
    time_model: str, momentum: float | None
) -> None:
    """`timing.collector_paused`: a collection the process owes runs after the callback's profile, not inside it
    (where it was charged as the callback's own time, 2026-12-07)."""

    class Collected(Counted):
        def __init__(self) -> None:
            super().__init__()
            self.log_of_calls.collector = []

        def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
            self.log_of_calls.collector.append(gc.isenabled())
            return super().training_step(batch, batch_idx)

        def configure_optimizers(self) -> Any:
            if momentum is None:
                return super().configure_optimizers()
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=momentum)

    module = Collected()
    tiny_trainer(callbacks=[elastic(False, time_model=time_model)], max_steps=4).fit(module, tiny_data())
    on = module.log_of_calls.collector
    assert len(on) > 4 and on.count(True) == 4  # the fit's 4 steps, and the profile's passes with it off
    assert on[-3:] == [True] * 3 and on[0] is (momentum is None)  # the first step profiles, or training starts to
    assert gc.isenabled()


def test_a_process_that_timed_its_measured_profile_warms_up_for_its_first_step_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The measured profile's passes warm the process up: its first window (auto, 6 steps planned) warms up for its
    first step only and times `T` on the next 2, so it ends after 3 steps; the selection comes at once. A later fit
    that reads the profile from the cache did not time it, but knows the steady step the first fit remembered in it:
    its window warms up for 2 steps and ends after 4, and runs on while its steps are not yet within 1.2x of that
    step. (Real 2 ms steps lie further apart than `WARM_SPREAD`: a warm window running on past a slow sample is
    tested on a virtual device, `test_contract`.)"""
    monkeypatch.setattr(warmup, "WARM_SPREAD", math.inf)
    timed = elastic(tmp_path, probe_steps="auto", time_model="measured", interval=2)  # selections every 16 steps
    tiny_trainer(callbacks=[timed], max_steps=64, max_epochs=8).fit(Counted(), tiny_data())
    fit = timed._fit
    assert fit is not None and fit.warmup.timed == "measured" and not fit.warmup.cold
    assert fit.schedule.first_window_end == warmup.PROFILED_WARMUP_STEPS + warmup.FIRST_STEADY_STEPS == 3
    assert timed.history[0].step == 3 and fit.plan.full_samples >= 1  # of 2: a 2 ms step paused by the OS is left out
    assert fit.warmup.full_steps == 1  # the first step alone is charged as warm-up
    cached = elastic(tmp_path, probe_steps="auto", time_model="measured", interval=2)
    tiny_trainer(callbacks=[cached], max_steps=64, max_epochs=8).fit(Counted(), tiny_data())
    again = cached._fit
    assert again is not None and again.warmup.cold and again.warmup.timed is None
    assert again.warmup.warm_step > 0  # the steady step the first fit remembered in the cache
    assert again.schedule.first_steps == 4 and cached.history[0].step == 4 + again.warmup.ran_on
    assert again.warmup.full_steps >= warmup.KNOWN_WARMUP_STEPS  # and any steps left out of `T`


def test_a_process_that_timed_its_analytic_profile_warms_up_for_its_first_step_only_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The analytic profile's plain forward pass after the fit's first step (that step counted its ops) leaves no
    step but the first slow, as the measured profile's passes do: its first window (auto, 6 steps planned) warms up
    for its first step, times `T` on the next 2 and ends after 3, charging the one warm-up step as such; the selection
    comes at once and no step runs on (with samples within `WARM_SPREAD` of each other, which real 2 ms steps are not
    reliably). Until 2026-12-07 it warmed up for 2 steps."""
    monkeypatch.setattr(warmup, "WARM_SPREAD", math.inf)
    timed = elastic(tmp_path, probe_steps="auto", time_model="flops", interval=2)  # selections every 16 steps
    tiny_trainer(callbacks=[timed], max_steps=64, max_epochs=8).fit(Counted(), tiny_data())
    fit = timed._fit
    assert fit is not None and fit.profile.method == "flops"
    assert fit.warmup.timed == "flops" and not fit.warmup.cold
    assert fit.schedule.first_window_end == warmup.PROFILED_WARMUP_STEPS + warmup.FIRST_STEADY_STEPS == 3
    assert timed.history[0].step == 3 and fit.warmup.ran_on == 0
    assert fit.warmup.full_steps == warmup.PROFILED_WARMUP_STEPS == 1
