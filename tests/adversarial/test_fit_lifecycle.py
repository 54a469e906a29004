"""Runs that start, stop and start again: resumes from checkpoints, a second fit with the same callback, two instances
in one Trainer, and the model given back as the user had it when a fit ends with a selection in force."""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_elastic import ElasticTensorSelection, reporting, warmup
from lightning_elastic.errors import ElasticConfigError
from lightning_elastic.planner import WallClockPlan
from lightning_elastic.profiling.runner import Runner
from tests.integration.test_callback import Recorder, elastic, fit
from tests.integration.test_contract import PROFILE, VirtualDevice
from tests.integration.tiny import Crash, TinyNet, tiny_data, tiny_trainer


def test_resume_mid_interval_keeps_the_mask_in_force(tmp_path: Path) -> None:
    """Crash after a checkpoint mid-interval, resume with ckpt_path: the same mask trains from the first step."""

    reference_recorder = Recorder()
    fit([elastic(interval=6), reference_recorder], max_steps=16)

    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=9, save_top_k=-1)
    crashed_recorder = Recorder()
    with pytest.raises(RuntimeError, match="simulated crash"):
        fit(
            [elastic(interval=6), checkpoint, Crash(at_step=10), crashed_recorder],
            max_steps=16,
            enable_checkpointing=True,
        )
    ckpt = tmp_path / "epoch=1-step=9.ckpt"
    assert ckpt.exists()
    saved = torch.load(ckpt, weights_only=False)["callbacks"]
    state = next(v for k, v in saved.items() if "ElasticTensorSelection" in k)
    resumed = elastic(interval=6)
    resumed_recorder = Recorder()
    tiny_trainer(callbacks=[resumed, resumed_recorder], max_steps=16, enable_checkpointing=False).fit(
        TinyNet(), tiny_data(), ckpt_path=ckpt
    )
    # At step 9 the mask chosen at step 8 is in force, and the next probe window opens at step 10.
    first = resumed_recorder.steps.index(9)
    assert resumed_recorder.trainable[first] == tuple(state["mask"])
    assert [r["step"] for r in state["history"]] == [2, 6]
    assert state["history"][-1]["mask"] == "".join("1" if m else "0" for m in state["mask"])
    # the schedule goes on where it was: the next probe window opens at step 10, the next selection at 12
    assert all(resumed_recorder.trainable[resumed_recorder.steps.index(10)])
    assert [r.step for r in resumed.history] == [2, 6, 12]
    # and the run before the crash trained exactly what an uninterrupted run trains
    assert reference_recorder.trainable[:10] == crashed_recorder.trainable[:10]


def test_a_resume_from_an_epochs_last_step_makes_the_selection_that_waited_for_the_next_epoch(tmp_path: Path) -> None:
    """A checkpoint of an epoch's last step (`every_n_train_steps` a multiple of the epoch) holds a probe window
    closed with its selection pending for the next epoch's start. Lightning begins that epoch in the resumed fit with
    no `on_train_epoch_start`: the selection must still come at its first step, not a whole epoch of every tensor."""

    def run(callbacks: list[Callback], **kwargs: Any) -> ElasticTensorSelection:
        callback = elastic(speedup=2.0, interval=1, interval_unit="epoch", probe_steps=2)
        torch.manual_seed(0)
        checkpoints = any(isinstance(c, ModelCheckpoint) for c in callbacks)
        tiny_trainer(callbacks=[callback, *callbacks], max_epochs=4, enable_checkpointing=checkpoints).fit(
            TinyNet(), tiny_data(), **kwargs
        )
        return callback

    reference, recorded = run([Recorder()]), Recorder()
    with pytest.raises(RuntimeError, match="simulated crash"):
        run([ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=8, save_top_k=-1), Crash(at_step=20)])
    ckpt = tmp_path / "epoch=1-step=16.ckpt"
    saved = torch.load(ckpt, weights_only=False)["callbacks"]
    assert next(v for k, v in saved.items() if "ElasticTensorSelection" in k)["pending_selection"]
    resumed = run([recorded], ckpt_path=ckpt)
    assert [r.step for r in resumed.history] == [r.step for r in reference.history] == [2, 8, 16, 24]
    assert resumed.history[2].mask == reference.history[2].mask  # decided on what the checkpoint kept
    trained = recorded.trainable[recorded.steps.index(16) : recorded.steps.index(22)]  # before the next window
    assert set(trained) == {tuple(resumed.history[2].mask)} and not all(trained[0])


def continued(**kwargs: Any) -> ElasticTensorSelection:
    return elastic(speedup=2.0, interval=1, interval_unit="epoch", probe_steps=1, **kwargs)


def test_a_fit_called_again_to_train_longer_plans_probes_and_selects_over_its_own_steps() -> None:
    """`Trainer.fit` again on the same Trainer goes on from step 16: its first step opens a probe window and its plan
    counts the 16 steps it runs, as a fresh fit of that length does (before: its first epoch trained every tensor
    outside any window, planned for 32 steps)."""
    fresh = continued()
    fit([fresh], max_epochs=2)
    callback, recorder, module = continued(), Recorder(), TinyNet()
    trainer = tiny_trainer(callbacks=[callback, recorder], max_epochs=2)
    trainer.fit(module, tiny_data())
    recorder.trainable.clear()
    trainer.fit_loop.max_epochs = 4
    trainer.fit(module, tiny_data())
    assert trainer.global_step == 32 and callback._fit is not None and callback._fit.origin == 16
    assert callback._fit.plan.total_steps == 16 and callback.report().steps == 16
    assert [r.step for r in callback.history] == [r.step for r in fresh.history] == [1, 8]
    assert all(recorder.trainable[0]) and callback.report().probe_steps == 2  # step 16, and the window before 24
    assert recorder.trainable[1:7] == [tuple(callback.history[0].mask)] * 6


def test_a_checkpoint_of_a_fit_without_the_callback_is_resumed_as_a_fit_from_its_step(tmp_path: Path) -> None:
    plain = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=12, save_top_k=-1)
    tiny_trainer(callbacks=[plain], max_epochs=2, enable_checkpointing=True).fit(TinyNet(), tiny_data())
    callback, recorder = continued(), Recorder()
    ckpt = tmp_path / "epoch=1-step=12.ckpt"  # 4 steps into the second epoch
    tiny_trainer(callbacks=[callback, recorder], max_epochs=4).fit(TinyNet(), tiny_data(), ckpt_path=ckpt)
    assert callback._fit is not None and callback._fit.plan.total_steps == 20
    assert callback._fit.schedule.steps_per_epoch == (4, 8)  # what was left of the epoch, then whole epochs
    assert [r.step for r in callback.history] == [1, 4, 12]  # after the first window, then at each epoch's start
    assert all(recorder.trainable[0]) and not all(recorder.trainable[1])


def test_a_fit_trained_longer_and_resumed_counts_from_where_it_started(tmp_path: Path) -> None:
    def longer(callbacks: list[Callback], ckpt: Path | None = None) -> ElasticTensorSelection:
        callback, module = continued(), TinyNet()
        checkpoints = any(isinstance(c, ModelCheckpoint) for c in callbacks)
        trainer = tiny_trainer(callbacks=[callback, *callbacks], max_epochs=2, enable_checkpointing=checkpoints)
        trainer.fit(module, tiny_data())
        trainer.fit_loop.max_epochs = 5
        trainer.fit(module, tiny_data(), ckpt_path=ckpt)
        return callback

    uninterrupted = longer([])
    with pytest.raises(RuntimeError, match="simulated crash"):
        longer([ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1), Crash(at_step=30)])
    ckpt = tmp_path / "epoch=3-step=28.ckpt"
    saved = torch.load(ckpt, weights_only=False)["callbacks"]
    assert next(v for k, v in saved.items() if "ElasticTensorSelection" in k)["origin"] == 16
    resumed = continued()
    tiny_trainer(callbacks=[resumed], max_epochs=5).fit(TinyNet(), tiny_data(), ckpt_path=ckpt)
    assert resumed._fit is not None and resumed._fit.origin == 16 and resumed._fit.plan.total_steps == 24
    assert [r.step for r in resumed.history] == [r.step for r in uninterrupted.history] == [1, 8, 16]


class BatchNormModes(Callback):
    """Per optimizer step: whether the BatchNorm layer `net.1` is in train mode, and whether its weight trains."""

    def __init__(self) -> None:
        self.by_step: dict[int, tuple[bool, bool]] = {}

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        layer = pl_module.net[1]
        self.by_step[trainer.global_step] = (layer.training, layer.weight.requires_grad)


def test_a_fit_resumed_mid_epoch_sets_the_batchnorm_modes_of_the_selection_in_force(tmp_path: Path) -> None:
    """Under `bn_policy="freeze"` the selection of step 2 freezes the BatchNorm layer's tensors and puts it in eval
    mode. A resume from step 5, mid-epoch, gets no `on_train_epoch_start`, where the modes were set: before, its steps
    up to the next window trained with the layer frozen but in train mode (its running statistics still updated)."""
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=5, save_top_k=-1)
    modes = BatchNormModes()
    with pytest.raises(RuntimeError, match="simulated crash"):
        fit(
            [elastic(interval=8, bn_policy="freeze"), checkpoint, modes, Crash(at_step=7)],
            max_steps=16,
            enable_checkpointing=True,
        )
    resumed = BatchNormModes()
    tiny_trainer(callbacks=[elastic(interval=8, bn_policy="freeze"), resumed], max_steps=16).fit(
        TinyNet(), tiny_data(), ckpt_path=next(tmp_path.glob("*step=5.ckpt"))
    )
    assert modes.by_step[5] == (False, False)  # frozen and in eval mode, as the selection of step 2 left it
    assert resumed.by_step[5] == modes.by_step[5]
    assert resumed.by_step[6] == modes.by_step[6] == (True, True)  # the probe window trains it, in train mode


def test_a_resumed_fit_leaves_a_batchnorm_layer_the_user_put_in_eval_mode_there(tmp_path: Path) -> None:
    """The checkpoint's process switched the BatchNorm layer (it was in train mode there); the resumed process's user
    put it in eval mode. Modes are not in a checkpoint: the layer stays in eval at every step and after the fit.
    Before, the checkpoint's list of switched layers came back with it, and the next window put the layer in train."""
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=5, save_top_k=-1)
    with pytest.raises(RuntimeError, match="simulated crash"):
        fit([elastic(interval=8, bn_policy="freeze"), checkpoint, Crash(at_step=7)], max_steps=16, enable_checkpointing=True)
    module = TinyNet()
    module.net[1].eval()
    resumed = BatchNormModes()
    tiny_trainer(callbacks=[elastic(interval=8, bn_policy="freeze"), resumed], max_steps=16).fit(
        module, tiny_data(), ckpt_path=next(tmp_path.glob("*step=5.ckpt"))
    )
    assert {trains for _, trains in resumed.by_step.values()} == {False, True}  # frozen, then trained by a window
    assert all(not mode for mode, _ in resumed.by_step.values()) and not module.net[1].training


class PlanAtStart(Callback):
    """The elastic callback's plan as the first resumed step starts."""

    def __init__(self, elastic: ElasticTensorSelection) -> None:
        self.elastic = elastic
        self.plan: dict[str, Any] | None = None

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if self.plan is None and self.elastic._fit is not None and self.elastic._fit.plan is not None:
            self.plan = self.elastic._fit.plan.state_dict()


def test_resume_keeps_the_account(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan goes on from the checkpoint's account, and the resumed process's own start (here 100 s of the
    clock as the fit begins) is charged on top of it, not dropped by the restore. Its start message gives no planned
    own-time share (the whole fit's probe windows are not this process's to plan)."""
    device = VirtualDevice(1.0)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=20, save_top_k=-1)
    first = ElasticTensorSelection(speedup=1.5, profile=PROFILE, clock=device.clock, interval=2)
    with pytest.raises(RuntimeError, match="simulated crash"):
        tiny_trainer(
            callbacks=[device, first, checkpoint, Crash(25)], max_steps=60, max_epochs=-1, enable_checkpointing=True
        ).fit(TinyNet(), tiny_data())
    ckpt = next(tmp_path.glob("*step=20.ckpt"))
    saved = torch.load(ckpt, weights_only=False)["callbacks"]
    state = next(v for k, v in saved.items() if "ElasticTensorSelection" in k)
    assert state["plan"]["steps_done"] == 20 and state["plan"]["spent"] > 0

    resumed = ElasticTensorSelection(speedup=1.5, profile=PROFILE, clock=device.clock, interval=2)
    watch = PlanAtStart(resumed)
    own_announce = reporting.announce
    shares: list[float | None] = []

    def slow_announce(*args: Any) -> None:
        shares.append(args[6])  # own_share, then whether the profile was timed
        device.now += 100.0
        own_announce(*args)

    monkeypatch.setattr(reporting, "announce", slow_announce)
    tiny_trainer(callbacks=[device, resumed, watch], max_steps=60, max_epochs=-1).fit(
        TinyNet(), tiny_data(), ckpt_path=ckpt
    )
    assert watch.plan is not None
    saved_plan = WallClockPlan.from_state(state["plan"])
    expected = dataclasses.replace(saved_plan, spent=saved_plan.spent + 100.0, overhead=saved_plan.overhead + 100.0)
    assert watch.plan == pytest.approx(expected.state_dict(), rel=1e-12)  # the clock's differences round
    assert resumed.summary()["fit_speedup"] > 1.0
    assert shares == [None]  # no own-time share of the whole fit announced: its start is spent


class OffTheModel(VirtualDevice):
    """The virtual device, on which a step that trains a selection takes `error` times what the time model predicts,
    and a full step exactly that: `T` is the model's, and the plan's correction learns `error`."""

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        named = dict(pl_module.named_parameters())
        trainable = tuple(named[n].requires_grad for n in PROFILE.names)
        self.now += (1.0 if all(trainable) else self.error) * self.model.predict(trainable)


@pytest.mark.parametrize("error", [0.7, 1.3])
def test_a_resumed_fit_goes_on_as_the_uninterrupted_one_with_the_correction_it_learnt(
    error: float, tmp_path: Path
) -> None:
    """Selected steps take `error` times the time model's prediction, so by the checkpoint (step 20, within the
    selection of step 16) the plan's correction is `error`, and every later target is divided by it. The resumed fit
    then spends, plans and selects exactly as the uninterrupted one. What legitimately differs: the resumed process's
    first `WARMUP_STEPS` steps are charged but are no samples, so the selection in force measured that many steps
    fewer (of the same seconds), and they count as warm-up. Before, the first resumed step was charged nothing: a
    resume mid-epoch (which is where `every_n_train_steps` checkpoints are) calls no `on_train_epoch_start`, where the
    step timer started."""
    settings: dict[str, Any] = dict(speedup=1.5, profile=PROFILE, interval=16, interval_unit="step")
    steps, at = 64, 20

    def data() -> DataLoader[tuple[torch.Tensor, ...]]:
        # 20 steps an epoch and unshuffled: the resumed process's new loader gives the batches the uninterrupted fit
        # trains on after step 20 (a shuffled one would start its generator again)
        return DataLoader(tiny_data(samples=640).dataset, batch_size=32)

    device = OffTheModel(error)
    uninterrupted = ElasticTensorSelection(clock=device.clock, **settings)
    torch.manual_seed(0)
    tiny_trainer(callbacks=[device, uninterrupted], max_steps=steps, max_epochs=-1).fit(TinyNet(), data())
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=at, save_top_k=-1)
    crashing = OffTheModel(error)
    first = ElasticTensorSelection(clock=crashing.clock, **settings)
    torch.manual_seed(0)  # the same initial weights
    with pytest.raises(RuntimeError, match="simulated crash"):
        tiny_trainer(
            callbacks=[crashing, first, checkpoint, Crash(at + 2)], max_steps=steps, max_epochs=-1,
            enable_checkpointing=True,
        ).fit(TinyNet(), data())
    ckpt = next(tmp_path.glob(f"*step={at}.ckpt"))
    saved = next(v for k, v in torch.load(ckpt, weights_only=False)["callbacks"].items() if "ElasticTensor" in k)
    resumed_device = OffTheModel(error)
    resumed = ElasticTensorSelection(clock=resumed_device.clock, **settings)
    watch = PlanAtStart(resumed)
    tiny_trainer(callbacks=[resumed_device, resumed, watch], max_steps=steps, max_epochs=-1).fit(
        TinyNet(), data(), ckpt_path=ckpt
    )
    assert saved["plan"]["correction"] == pytest.approx(error) and saved["plan"]["full_samples"] > 0
    assert watch.plan == pytest.approx(saved["plan"])  # restored as saved (the fake clock charges no start)
    reference, history = uninterrupted.history, resumed.history
    in_force = max(k for k, r in enumerate(reference) if r.step <= at)
    assert [r.step for r in reference] == [r.step for r in history] and reference[in_force + 1].step > at
    for k, (ours, theirs) in enumerate(zip(history, reference, strict=True)):
        assert ours.decision.mask == theirs.decision.mask and ours.replanned == theirs.replanned, k
        assert ours.decision.importance == pytest.approx(theirs.decision.importance, rel=1e-9), k
        assert ours.decision.target_seconds == pytest.approx(theirs.decision.target_seconds, rel=1e-9), k
        assert ours.decision.predicted_seconds == pytest.approx(theirs.decision.predicted_seconds, rel=1e-9), k
        assert ours.full_seconds == pytest.approx(theirs.full_seconds, rel=1e-9), k
        skipped = warmup.WARMUP_STEPS if k == in_force else 0
        assert len(ours.measured_seconds) == len(theirs.measured_seconds) - skipped, k
        assert ours.measured_step == pytest.approx(theirs.measured_step, rel=1e-9), k  # steps alike, fewer of them
    assert resumed._fit is not None and uninterrupted._fit is not None
    ours_plan, theirs_plan = resumed._fit.plan.state_dict(), uninterrupted._fit.plan.state_dict()
    # the correction learnt from the same ratios, from WARMUP_STEPS samples fewer (the resumed process's warm-up)
    assert ours_plan.pop("selected_samples") == theirs_plan.pop("selected_samples") - warmup.WARMUP_STEPS
    assert ours_plan == pytest.approx(theirs_plan, rel=1e-9)
    assert resumed._fit.plan.correction == pytest.approx(error)
    ours_summary, theirs_summary = resumed.summary(), uninterrupted.summary()
    for figure in ("spent_seconds", "planned_seconds", "full_fit_seconds", "fit_speedup", "probe_seconds"):
        assert ours_summary[figure] == pytest.approx(theirs_summary[figure], rel=1e-9), figure
    selected = reference[in_force].measured_seconds[0]  # each step of the selection in force took that
    assert ours_summary["warmup_seconds"] == pytest.approx(
        theirs_summary["warmup_seconds"] + warmup.WARMUP_STEPS * selected, rel=1e-9
    )


def test_a_resume_before_t_is_measured_keeps_the_warm_up_the_first_window_measured(tmp_path: Path) -> None:
    """The first window (2 steps, both of the process's slow first steps) measures full fine-tuning's warm-up, but
    only a later window's steady `T` turns it into the plan's `warmup`. A checkpoint in between carries it, so the
    resumed fit plans with what the uninterrupted one does (before, the resumed one planned with none)."""
    settings: dict[str, Any] = dict(speedup=1.5, profile=PROFILE, interval=8, interval_unit="step", probe_steps=2)

    def device() -> VirtualDevice:
        return VirtualDevice(1.0, slow=(2, 1.6))

    plain = device()
    uninterrupted = ElasticTensorSelection(clock=plain.clock, **settings)
    tiny_trainer(callbacks=[plain, uninterrupted], max_steps=24, max_epochs=-1).fit(TinyNet(), tiny_data())
    assert uninterrupted._fit is not None
    assert uninterrupted._fit.plan.warmup == pytest.approx(2 * 0.6 * PROFILE.t_full)
    crashing = device()
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1)
    first = ElasticTensorSelection(clock=crashing.clock, **settings)
    with pytest.raises(RuntimeError, match="simulated crash"):
        tiny_trainer(
            callbacks=[crashing, first, checkpoint, Crash(5)], max_steps=24, max_epochs=-1, enable_checkpointing=True
        ).fit(TinyNet(), tiny_data())
    ckpt = next(tmp_path.glob("*step=4.ckpt"))
    resumed_device = device()
    resumed = ElasticTensorSelection(clock=resumed_device.clock, **settings)
    tiny_trainer(callbacks=[resumed_device, resumed], max_steps=24, max_epochs=-1).fit(
        TinyNet(), tiny_data(), ckpt_path=ckpt
    )
    assert resumed._fit is not None and resumed._fit.plan.warmup == pytest.approx(uninterrupted._fit.plan.warmup)


def test_the_model_is_given_back_as_the_user_had_it() -> None:
    """A fit ending while a selection is in force leaves every tensor's `requires_grad` as it was before."""
    module = TinyNet()
    module.net[0].bias.requires_grad_(False)  # frozen by the user
    callback = ElasticTensorSelection(
        speedup=1.6, interval=4, interval_unit="step", probe_steps=2, profile=PROFILE, calibrate=False
    )
    during: list[tuple[bool, ...]] = []

    class Watch(Callback):
        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
            during.append(tuple(p.requires_grad for p in pl_module.parameters()))

    tiny_trainer(callbacks=[callback, Watch()], max_steps=7).fit(module, tiny_data())
    assert not all(during[-1])  # a selection was in force when the fit ended
    assert [p.requires_grad for p in module.parameters()] == [n != "net.0.bias" for n, _ in module.named_parameters()]


def test_a_second_fit_starts_clean() -> None:
    callback = ElasticTensorSelection(speedup=1.6, interval=1, probe_steps=2, profile=PROFILE, calibrate=False)
    tiny_trainer(callbacks=[callback], max_epochs=3).fit(TinyNet(), tiny_data())
    assert [r.epoch for r in callback.history] == [0, 1, 2]
    tiny_trainer(callbacks=[callback], max_epochs=2).fit(TinyNet(), tiny_data())
    assert [r.epoch for r in callback.history] == [0, 1]
    assert callback.summary()["selections"] == 2
    assert all(math.isfinite(v) for v in callback.history[0].decision.importance)
    assert any(callback.history[0].decision.importance)  # measured in this fit's window, not zero


def test_two_instances_in_one_trainer_are_refused_at_setup() -> None:
    first = ElasticTensorSelection(speedup=1.6, probe_steps=2, profile=PROFILE, calibrate=False)
    second = ElasticTensorSelection(speedup=1.4, probe_steps=2, profile=PROFILE, calibrate=False)
    assert first.state_key != second.state_key  # a checkpoint keeps each one's state apart all the same
    model, trainer = TinyNet(), tiny_trainer(callbacks=[first, second], max_epochs=1)
    with pytest.raises(ElasticConfigError, match=r"must be the only instance in a Trainer .*separate fits\. Found: 2$"):
        trainer.fit(model, tiny_data())
    assert trainer.global_step == 0 and all(p.requires_grad for p in model.parameters())


def test_a_callback_off_in_a_fast_dev_run_selects_in_the_next_fit() -> None:
    callback = elastic(interval=1, interval_unit="epoch", probe_steps=2)
    fit([callback], fast_dev_run=True)
    recorder = Recorder()
    fit([callback, recorder], max_epochs=2)
    assert [r.epoch for r in callback.history] == [0, 1]
    assert any(not all(t) for t in recorder.trainable)  # selected steps between the probe windows


class RaisesInItsStep(TinyNet):
    """`training_step` raises at optimizer step `at_step` of the training loop (not in a profiling pass), after its
    forward pass."""

    def __init__(self, at_step: int) -> None:
        super().__init__()
        self.at_step = at_step
        self.loop_step: int | None = None  # Lightning's step under way; profiling passes in `on_train_start` run none
        self.hooked: list[int] = []  # modules with forward pre-hooks as the step raises

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.loop_step = self.global_step

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.loop_step == self.at_step:
            self.hooked.append(sum(bool(m._forward_pre_hooks) for m in self.modules()))
            raise RuntimeError("simulated crash")
        return loss


class RaisesAfterBackward(Callback):
    """Raises at the first step's `on_after_backward`: before the elastic callback (after it in the list) sees it."""

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        raise RuntimeError("simulated crash")


def users_model(module: TinyNet) -> TinyNet:
    module.net[0].bias.requires_grad_(False)  # frozen by the user
    return module


def is_as_the_user_had_it(module: TinyNet) -> bool:
    flags = [p.requires_grad for p in module.parameters()]
    return flags == [n != "net.0.bias" for n, _ in module.named_parameters()] and all(
        m.training for m in module.modules()
    )


@pytest.mark.parametrize("raiser", ["callback", "training_step"])
def test_a_fit_that_raises_mid_fit_gives_the_model_back(raiser: str) -> None:
    """Step 5 raises with the selection of step 4 in force and `net.1` (BatchNorm, `train_never`) in eval mode."""
    module = users_model(RaisesInItsStep(at_step=5) if raiser == "training_step" else TinyNet())
    callback = elastic(train_never=["net.1.*"], bn_policy="freeze")
    recorder = Recorder()
    modes: list[bool] = []

    class Modes(Callback):
        def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
            modes.append(module.net[1].training)

    callbacks = [callback, recorder, Modes()] + ([Crash(at_step=5)] if raiser == "callback" else [])
    with pytest.raises(RuntimeError, match="simulated crash"):
        tiny_trainer(callbacks=callbacks, max_steps=8).fit(module, tiny_data())
    assert recorder.steps == [0, 1, 2, 3, 4, 5] and [r.step for r in callback.history] == [4]  # window: steps 0-3
    names = [n for n, _ in module.named_parameters()]
    candidates = [k for k, n in enumerate(names) if n != "net.0.bias" and not n.startswith("net.1.")]
    assert all(recorder.trainable[1][k] for k in candidates)  # the probe window trained every candidate
    assert not all(recorder.trainable[5][k] for k in candidates)  # the selection of step 4 froze some
    assert modes == [False] * 6
    assert is_as_the_user_had_it(module)


@pytest.mark.parametrize("raiser", ["training_step", "on_after_backward"])
def test_a_first_step_that_raises_before_its_update_gives_the_model_back(raiser: str) -> None:
    """Profiling deferred to the first step, which raises before its update: the `train_never` tensors and the
    BatchNorm layer put in eval mode as training started are given back, and no recording hook is left."""
    module = users_model(RaisesInItsStep(at_step=0 if raiser == "training_step" else -1))
    before = [p.detach().clone() for p in module.parameters()]
    callback = ElasticTensorSelection(
        speedup=1.05, probe_steps=2, cache_dir=False, calibrate=False, train_never=["net.1.*"], bn_policy="freeze"
    )
    callbacks = [RaisesAfterBackward(), callback] if raiser == "on_after_backward" else [callback]
    with pytest.raises(RuntimeError, match="simulated crash"):
        tiny_trainer(callbacks=callbacks, max_steps=8).fit(module, tiny_data())
    assert callback.timing_profile is None and callback._fit is None  # it raised inside the deferred first step
    assert module.hooked == ([len(list(module.modules()))] if raiser == "training_step" else [])
    assert all(not m._forward_pre_hooks for m in module.modules())
    assert is_as_the_user_had_it(module)
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))


@pytest.mark.usefixtures("ticking_profiler")  # profiled for real, at 1.001
def test_a_checkpoint_whose_profile_covers_the_train_never_tensors_is_resumed_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checkpoints written before `train_never` tensors were frozen ahead of profiling hold a measured profile that
    covers them, keyed with them trainable. A resume with the same settings keeps it (no profiling), with the
    checkpoint's selection, and never trains them."""
    settings: dict[str, Any] = dict(speedup=1.001, probe_steps=2, interval=1, calibrate=False, cache_dir=False)
    whole = ElasticTensorSelection(**settings)
    tiny_trainer(callbacks=[whole], max_steps=2).fit(TinyNet(), tiny_data())
    old_profile = whole.timing_profile  # measured with every tensor trainable, as those versions measured it
    assert old_profile is not None and "net.0.weight" in old_profile.names
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=10, save_top_k=-1)
    never = ElasticTensorSelection(train_never=["net.0.*"], profile=old_profile, **settings)
    tiny_trainer(callbacks=[never, checkpoint], max_steps=10, enable_checkpointing=True).fit(TinyNet(), tiny_data())
    ckpt = next(tmp_path.glob("*step=10.ckpt"))
    saved = torch.load(ckpt, weights_only=False)["callbacks"]
    state = next(v for k, v in saved.items() if "ElasticTensorSelection" in k)
    assert state["profile"] == old_profile.to_dict() and len(state["mask"]) == len(old_profile.names)

    runs: list[int] = []
    own_run = Runner.run
    monkeypatch.setattr(Runner, "run", lambda self, *args: runs.append(1) or own_run(self, *args))
    resumed, recorder = ElasticTensorSelection(train_never=["net.0.*"], **settings), Recorder()
    tiny_trainer(callbacks=[resumed, recorder], max_steps=16).fit(TinyNet(), tiny_data(), ckpt_path=ckpt)
    assert runs == []  # not profiled again
    assert resumed.timing_profile == old_profile
    assert recorder.trainable[0] == tuple(state["mask"])  # the checkpoint's selection trains the first resumed step
    assert not any(step[k] for step in recorder.trainable for k in (0, 1))  # net.0.weight, net.0.bias: never


@pytest.mark.usefixtures("ticking_profiler")  # profiled for real, at 1.001
def test_a_checkpoint_of_a_fit_over_other_tensors_resumes_its_account_only(tmp_path: Path) -> None:
    """The checkpoint's fit froze `net.0` before profiling (8 tensors); the resumed fit trains all 10, so it profiles
    again and the checkpoint's per-tensor state (importance, mask, history) cannot apply: said, and left out, with
    its wall-clock account kept (restoring that state crashed on the length mismatch)."""
    settings: dict[str, Any] = dict(speedup=1.001, probe_steps=2, interval=1, calibrate=False, cache_dir=False)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=10, save_top_k=-1)
    never = ElasticTensorSelection(train_never=["net.0.*"], **settings)
    tiny_trainer(callbacks=[never, checkpoint], max_steps=10, enable_checkpointing=True).fit(TinyNet(), tiny_data())
    ckpt = next(tmp_path.glob("*step=10.ckpt"))
    assert never._fit is not None and len(never._fit.params) == 8
    spent = never._fit.plan.spent

    resumed, recorder = ElasticTensorSelection(**settings), Recorder()
    with pytest.warns(UserWarning, match=r"the checkpoint's fit selected among 8 tensors, this fit among 10 .* "
                      r"not resumed; its wall-clock account is"):
        tiny_trainer(callbacks=[resumed, recorder], max_steps=24).fit(TinyNet(), tiny_data(), ckpt_path=ckpt)
    fit_ = resumed._fit
    assert fit_ is not None and len(fit_.params) == 10 and fit_.plan.spent > spent >= 0
    assert all(recorder.trainable[0])  # no selection of the old fit: every tensor trains until the next one
    assert [r.step for r in resumed.history] == [16] and len(resumed.history[0].mask) == 10


def test_a_batchnorm_layer_the_user_left_in_eval_mode_stays_there() -> None:
    """Under `bn_policy="freeze"` a BatchNorm layer in eval mode by the user's choice, inside a model in train mode,
    keeps that mode at every step (selections freeze its tensors, probe windows train them) and after the fit."""
    module = TinyNet()
    module.net[1].eval()
    callback = ElasticTensorSelection(
        speedup=1.6, interval=4, interval_unit="step", probe_steps=2, profile=PROFILE, calibrate=False,
        bn_policy="freeze",
    )
    names = [n for n, _ in module.named_parameters()]
    bn = [k for k, n in enumerate(names) if n.startswith("net.1.")]
    seen: list[tuple[bool, bool]] = []  # (its tensors train, its mode) at each step

    class Watch(Callback):
        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
            flags = [p.requires_grad for p in pl_module.parameters()]
            seen.append((any(flags[k] for k in bn), module.net[1].training))

    tiny_trainer(callbacks=[callback, Watch()], max_steps=14).fit(module, tiny_data())
    assert {trains for trains, _ in seen} == {False, True}  # frozen by a selection, trained by a window after it
    assert all(not mode for _, mode in seen)
    assert not module.net[1].training and all(m.training for n, m in module.named_modules() if n != "net.1")


def older_checkpoint(tmp_path: Path, settings: dict[str, Any], reorder: bool = False) -> tuple[Path, dict[str, Any]]:
    """A 10-step fit's checkpoint with its profile rewritten in format 1 (no `shapes`), its tensors listed in reverse
    order when `reorder`; and the callback's state in it."""
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=10, save_top_k=-1)
    first = ElasticTensorSelection(**settings)
    tiny_trainer(callbacks=[first, checkpoint], max_steps=10, enable_checkpointing=True).fit(TinyNet(), tiny_data())
    ckpt = next(tmp_path.glob("*step=10.ckpt"))
    saved = torch.load(ckpt, weights_only=False)
    state = next(v for k, v in saved["callbacks"].items() if "ElasticTensorSelection" in k)
    state["profile"] = {k: v for k, v in state["profile"].items() if k != "shapes"} | {"version": 1}
    if reorder:
        state["profile"]["names"] = state["profile"]["names"][::-1]
    torch.save(saved, ckpt)
    return ckpt, state


@pytest.mark.usefixtures("ticking_profiler")  # profiled for real, at 1.001
def test_a_checkpoint_whose_profile_listed_its_tensors_otherwise_resumes_its_account_only(tmp_path: Path) -> None:
    """The checkpoint's profile is measured again (format 1); its tensors were listed in another order than the new
    profile's, so its mask and importance (in that order) cannot apply: said, and left out. Before: restored by count,
    each flag on another tensor."""
    settings: dict[str, Any] = dict(speedup=1.001, probe_steps=2, interval=1, calibrate=False, cache_dir=False)
    ckpt, _ = older_checkpoint(tmp_path, settings, reorder=True)
    resumed, recorder = ElasticTensorSelection(**settings), Recorder()
    with pytest.warns(UserWarning, match=r"selected among 10 tensors, this fit among 10, named or ordered otherwise"):
        tiny_trainer(callbacks=[resumed, recorder], max_steps=16).fit(TinyNet(), tiny_data(), ckpt_path=ckpt)
    assert all(recorder.trainable[0])  # no selection of the old fit: every tensor trains until the next one


@pytest.mark.usefixtures("ticking_profiler")  # profiled for real, at 1.001
def test_a_checkpoint_whose_profile_is_in_an_older_format_is_resumed_with_a_new_profile(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A checkpoint written before the profile format's last change (format 1: no `shapes`) holds a profile this
    version cannot read: the resumed fit says so and profiles again, and keeps the checkpoint's selection (reading it
    raises `StaleProfileError`, which would leave no fit able to resume from a checkpoint of an earlier version)."""
    settings: dict[str, Any] = dict(speedup=1.001, probe_steps=2, interval=1, calibrate=False, cache_dir=False)
    ckpt, state = older_checkpoint(tmp_path, settings)
    resumed, recorder = ElasticTensorSelection(**settings), Recorder()
    with caplog.at_level(logging.INFO):
        tiny_trainer(callbacks=[resumed, recorder], max_steps=16).fit(TinyNet(), tiny_data(), ckpt_path=ckpt)
    assert "the checkpoint's timing profile was written in another format (`data[\"version\"]` must be 2. Found: " \
        "1); profiling again." in caplog.text
    assert resumed.timing_profile is not None and resumed.timing_profile.shapes is not None
    assert recorder.trainable[0] == tuple(state["mask"])
