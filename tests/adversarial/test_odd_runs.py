"""Odd modules and odd runs: each ends in the same selection as the plain fit, or in a clear refusal before training."""

from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import BackboneFinetuning, Callback, GradientAccumulationScheduler, ModelCheckpoint
from torch import nn

from lightning_elastic import ElasticTensorSelection
from lightning_elastic.errors import ElasticConfigError
from lightning_elastic.startup import step_profile
from tests.integration.tiny import Crash, TinyNet, synthetic_profile, tiny_data, tiny_trainer

PROFILE = synthetic_profile(TinyNet())


def elastic(**kwargs: Any) -> ElasticTensorSelection:
    settings: dict[str, Any] = dict(
        speedup=1.6, interval=1, interval_unit="epoch", probe_steps=2, profile=PROFILE, calibrate=False
    )
    settings.update(kwargs)
    return ElasticTensorSelection(**settings)


class Masks(Callback):
    """The trainable set of every optimizer step, by global step."""

    def __init__(self) -> None:
        self.by_step: dict[int, tuple[bool, ...]] = {}

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.by_step[trainer.global_step] = tuple(p.requires_grad for p in pl_module.parameters())


class MicroBatchMasks(Callback):
    """The trainable set of every micro-batch, by the optimizer step it belongs to."""

    def __init__(self) -> None:
        self.by_step: dict[int, list[tuple[bool, ...]]] = {}

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.by_step.setdefault(trainer.global_step, []).append(tuple(p.requires_grad for p in pl_module.parameters()))


def test_resume_from_an_end_of_epoch_checkpoint_selects_what_the_uninterrupted_fit_selects(tmp_path: Path) -> None:
    """The epoch's last step closed a probe window; its importance must survive into the resumed selection."""
    torch.manual_seed(0)
    plain = Masks()
    tiny_trainer(callbacks=[elastic(), plain], max_epochs=4).fit(TinyNet(), tiny_data())

    torch.manual_seed(0)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1)
    with pytest.raises(RuntimeError, match="simulated crash"):
        tiny_trainer(
            callbacks=[elastic(), checkpoint, Crash(at_step=18)], max_epochs=4, enable_checkpointing=True
        ).fit(TinyNet(), tiny_data())
    ckpt = tmp_path / "epoch=1-step=16.ckpt"  # saved at the end of epoch 1: its window closed, a selection pending
    resumed = Masks()
    torch.manual_seed(0)
    tiny_trainer(callbacks=[elastic(), resumed], max_epochs=4).fit(TinyNet(), tiny_data(), ckpt_path=ckpt)
    assert sorted(resumed.by_step) == list(range(16, 32))
    assert all(resumed.by_step[s] == plain.by_step[s] for s in resumed.by_step)


class Backbone(TinyNet):
    @property
    def backbone(self) -> nn.Module:
        return self.net[:4]


def test_another_callback_that_unfreezes_tensors_is_refused() -> None:
    with pytest.raises(ElasticConfigError, match=r"must be the only one to set `requires_grad`.*Found changed"):
        tiny_trainer(callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1), elastic()], max_epochs=3).fit(
            Backbone(), tiny_data()
        )


@pytest.mark.usefixtures("ticking_profiler")
def test_tensors_frozen_before_the_fit_and_unfrozen_by_another_callback_are_refused() -> None:
    # BackboneFinetuning freezes the backbone before training starts, so a real profile covers the head only; when
    # it unfreezes the backbone at epoch 1, those tensors would train outside the budget.
    model, masks = Backbone(), Masks()
    frozen = ["net.0.weight", "net.0.bias", "net.3.weight", "net.3.bias"]  # its BatchNorm stays trainable (`train_bn`)
    found = re.escape(f"Found changed outside the callback: {frozen}")
    with pytest.raises(ElasticConfigError, match=r"must be the only one to set `requires_grad`.*" + found):
        callbacks = [BackboneFinetuning(unfreeze_backbone_at_epoch=1), elastic(profile=None), masks]
        tiny_trainer(callbacks=callbacks, max_epochs=3).fit(model, tiny_data())
    assert max(masks.by_step) == 7  # refused as epoch 1 starts (8 steps an epoch), before a step trains the backbone
    # every flag given back as it was when training started: the backbone as BackboneFinetuning had frozen it
    assert [name for name, p in model.named_parameters() if not p.requires_grad] == frozen


def test_lazy_modules_are_refused_before_training() -> None:
    class Lazy(TinyNet):
        def __init__(self) -> None:
            super().__init__()
            self.net[0] = nn.LazyLinear(64)

    with pytest.raises(ElasticConfigError, match=r"lazy modules must be materialised first.*net\.0\.weight"):
        tiny_trainer(callbacks=[elastic(profile=None)], max_epochs=1).fit(Lazy(), tiny_data())


def test_numpy_scalars_are_accepted() -> None:
    callback = ElasticTensorSelection(speedup=np.float32(1.5), interval=np.int64(2), resolution=np.int32(500))
    settings = callback._settings
    assert (settings.interval, settings.speedup, settings.resolution) == (2, 1.5, 500)
    assert (type(settings.interval), type(settings.speedup), type(settings.resolution)) == (int, float, int)


@pytest.mark.parametrize(
    ("value", "message"),
    [(123, r"`cache_dir` must be a directory path, None \(the user cache\) or False. Found: 123"), (True, "True")],
)
def test_a_bad_cache_dir_is_refused_by_the_constructor(value: object, message: str) -> None:
    with pytest.raises(ElasticConfigError, match=message):
        ElasticTensorSelection(cache_dir=value)  # type: ignore[arg-type]


@pytest.mark.usefixtures("ticking_profiler")
def test_a_cache_that_cannot_be_written_warns_and_the_fit_goes_on_with_its_profile(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    cache = tmp_path / "file" / "profiles"  # under a file: creating it fails (as root, unlike a read-only folder)
    callback = elastic(profile=None, cache_dir=cache)
    trainer = tiny_trainer(callbacks=[callback], max_epochs=2)
    with pytest.warns(UserWarning, match=rf"Timing profile cache {re.escape(str(cache))}/timing-\w+\.json could not be written \(\[Errno 20\] Not a directory"):
        trainer.fit(TinyNet(), tiny_data())
    assert trainer.global_step == 16 and [r.epoch for r in callback.history] == [0, 1]
    assert callback.timing_profile is not None and callback.timing_profile.names == PROFILE.names


def test_a_cache_dir_that_is_a_file_is_refused_before_profiling(tmp_path: Path) -> None:
    file = tmp_path / "not_a_dir"
    file.write_text("x")
    model, trainer = TinyNet(), tiny_trainer(callbacks=[elastic(profile=None, cache_dir=file)], max_epochs=1)
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ElasticConfigError, match=r"`cache_dir` must be a directory .*Found: a file"):
        trainer.fit(model, tiny_data())
    assert trainer.global_step == 0  # before the first update (the profile runs inside the first step, if at all)
    assert all(torch.equal(w, p) for w, p in zip(weights, model.parameters(), strict=True))


def test_a_gradient_accumulation_schedule_plans_its_first_epoch_with_its_own_count() -> None:
    """The scheduler sets the Trainer's count only as each epoch starts, after `on_train_start`, where a fit given a
    profile begins: the step's profile is still the pass times the scheduler's count for epoch 0 (4), and `t_step`,
    a step of one micro-batch, is no reference for it. Before: planned as one micro-batch a step."""
    given = replace(PROFILE, t_step=0.01, t_update=0.002)
    callback = elastic(profile=given, probe_steps=1)  # epoch 0 has 2 optimizer steps of 4 micro-batches
    scheduler = GradientAccumulationScheduler(scheduling={0: 4, 1: 1})
    tiny_trainer(callbacks=[callback, scheduler], max_epochs=1).fit(TinyNet(), tiny_data())
    assert callback._fit is not None
    assert callback._fit.profile.t_full == pytest.approx(4 * PROFILE.t_full) and callback._fit.profile.t_step == 0.0
    assert callback._fit.profile.t_update == 0.0
    assert step_profile(tiny_trainer(), given) is given  # one micro-batch a step: the pass itself, `t_step` kept


def test_a_gradient_accumulation_schedule_keeps_selecting_every_epoch() -> None:
    """Epoch 0 steps every batch (8 steps), later epochs every 2 batches (4 steps): a selection as every epoch starts,
    each after a probe window of the epoch before, and every micro-batch of a step trains the same tensors."""

    callback, masks = elastic(), MicroBatchMasks()
    tiny_trainer(callbacks=[callback, GradientAccumulationScheduler({1: 2}), masks], max_epochs=4).fit(
        TinyNet(), tiny_data()
    )
    assert [(r.step, r.epoch) for r in callback.history] == [(2, 0), (8, 1), (12, 2), (16, 3)]
    assert callback._fit is not None and callback._fit.plan is not None and callback._fit.plan.total_steps == 20
    everything = (True,) * len(PROFILE.names)
    windows = [0, 1, 6, 7, 10, 11, 14, 15]
    assert [s for s in range(20) if masks.by_step[s] == [everything] * len(masks.by_step[s])] == windows
    assert all(len(set(masks.by_step[s])) == 1 for s in range(20))
    assert [len(masks.by_step[s]) for s in (0, 7, 8, 19)] == [1, 1, 2, 2]


def test_a_sparse_embedding_is_refused_naming_the_parameter() -> None:
    class Embedded(TinyNet):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 16, sparse=True)

    with pytest.raises(
        ElasticConfigError, match=r"needs dense gradients .* Found sparse gradients for: \['embed\.weight'\]"
    ):
        tiny_trainer(callbacks=[elastic(profile=synthetic_profile(Embedded()))], max_epochs=1).fit(
            Embedded(), tiny_data()
        )
    callback = elastic(profile=synthetic_profile(Embedded()), train_never=["embed.*"])  # the way out it names
    tiny_trainer(callbacks=[callback], max_epochs=2).fit(Embedded(), tiny_data())
    assert [r.step for r in callback.history] == [2, 8] and not any(r.mask[-1] for r in callback.history)


@pytest.mark.parametrize("probe_steps", [42, "auto"])
def test_epochs_too_short_for_the_windows_waste_no_selection(probe_steps: int | str) -> None:
    """48 steps an epoch: 42 probe steps would leave the first selection (step 42) overwritten by the next window
    (steps 6 to 47 of the epoch) before it trains. The first window runs on to the epoch's end instead, said
    before training; auto-sized windows leave every selection at least as many steps as they probed."""
    callback, masks = elastic(probe_steps=probe_steps, speedup=1.3), Masks()
    data = tiny_data(samples=192, batch_size=4)
    trainer = tiny_trainer(callbacks=[callback, masks], max_epochs=2)
    if probe_steps == 42:
        with pytest.warns(UserWarning, match=r"`probe_steps` 42 leave the first selection no step to train .* "
                          r"runs on until step 48 .* Fewer than 24 `probe_steps`"):
            trainer.fit(TinyNet(), data)
        assert [(r.step, r.epoch) for r in callback.history] == [(48, 1)]
        assert all(all(masks.by_step[s]) for s in range(48)) and not all(masks.by_step[48])
    else:
        trainer.fit(TinyNet(), data)
    assert callback._fit is not None
    probes = callback._fit.schedule.probe_steps
    least = probes if probe_steps == "auto" else 1  # an explicit window takes what it asks of later intervals
    starts = [r.step for r in callback.history] + [96]
    for record, start, end in zip(callback.history, starts, starts[1:], strict=False):
        trained = [s for s in range(start, end) if masks.by_step[s] == tuple(record.mask)]
        assert len(trained) >= least, (record.step, probes)


class NonFiniteFirstLayer(TinyNet):
    """From optimizer step 2 on, the first layer's weight gradient is NaN when the callback reads it and zero when
    the optimizer applies it (as an AMP step skipped on overflow leaves the weights): its importance is not finite,
    the model stays finite. `nonfinite_steps` counts the steps that measured it so."""

    def __init__(self) -> None:
        super().__init__()
        self.nonfinite_steps = 0

    def on_after_backward(self) -> None:
        grad = self.net[0].weight.grad
        if self.trainer.global_step >= 2 and grad is not None:
            grad.fill_(math.nan)
            self.nonfinite_steps += 1

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:  # after the callback's hook
        grad = self.net[0].weight.grad
        if grad is not None and not grad.isfinite().all():
            grad.zero_()


def test_non_finite_importance_is_counted_warned_once_and_the_last_finite_value_kept() -> None:
    torch.manual_seed(0)
    module = NonFiniteFirstLayer()
    callback = elastic(interval=4, interval_unit="step")
    with pytest.warns(UserWarning, match=r"the importance of \['net.0.weight'\] was not finite") as caught:
        tiny_trainer(callbacks=[callback], max_steps=16).fit(module, tiny_data())
    assert sum("was not finite" in str(w.message) for w in caught) == 1  # every window from the first on had some
    first, *later = [record.decision.importance for record in callback.history]
    assert len(later) == 2  # three selections in 16 steps
    assert all(importance[1:] != first[1:] for importance in later)  # the other tensors measured afresh
    latest = callback._fit.latest  # type: ignore[union-attr]
    assert latest.values[0] == first[0] and latest.levels[0] == 1.0  # its last finite value, kept ...
    assert later[-1][0] == pytest.approx(first[0] * latest.level, rel=1e-12) and latest.level != 1.0  # ... and aged
    assert callback.report().nonfinite_steps == module.nonfinite_steps >= 2


def test_stochastic_weight_averaging_gets_the_users_model_back() -> None:
    """SWA copies the model before training and averages it from epoch 2: its copy and the model it leaves keep
    the user's flags (net.0.weight frozen by the user), every BatchNorm trains, and selections go on as usual."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    module = TinyNet()
    module.net[0].weight.requires_grad_(False)
    user_flags = [p.requires_grad for p in module.parameters()]
    callback, swa = elastic(), StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=2)
    tiny_trainer(callbacks=[callback, swa], max_epochs=4).fit(module, tiny_data())
    assert [(r.step, r.epoch) for r in callback.history] == [(2, 0), (8, 1), (16, 2), (24, 3)]
    assert all(not r.mask[0] for r in callback.history)
    assert [p.requires_grad for p in module.parameters()] == user_flags
    assert swa._average_model is not None
    assert [p.requires_grad for p in swa._average_model.parameters()] == user_flags
    assert all(m.training for m in module.modules())


def test_step_intervals_with_max_steps_give_the_model_back() -> None:
    callback, masks = elastic(interval=3, interval_unit="step"), Masks()
    module = TinyNet()
    tiny_trainer(callbacks=[callback, masks], max_steps=11, max_epochs=-1).fit(module, tiny_data())
    assert [r.step for r in callback.history] == [3, 6, 9]  # the window [1, 3) would overwrite a selection at 2
    assert not all(masks.by_step[10])  # the last step trained a selection
    assert all(p.requires_grad for p in module.parameters()) and all(m.training for m in module.modules())


class Tied(TinyNet):
    def __init__(self) -> None:
        super().__init__()
        self.net[5].weight = self.net[3].weight  # one tensor, two layers


class Unused(TinyNet):
    def __init__(self) -> None:
        super().__init__()
        self.spare = nn.Linear(64, 64)  # never in the forward pass: no gradient, no importance


class Groups(TinyNet):
    def configure_optimizers(self) -> Any:
        head = list(self.net[-1].parameters())
        body = [p for p in self.parameters() if all(p is not h for h in head)]
        return torch.optim.SGD([{"params": body, "lr": 0.01}, {"params": head, "lr": 0.1}], momentum=0.9)


class Recurrent(TinyNet):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(16, 16, batch_first=True)
        self.attention = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sequence, _ = self.rnn(x.unsqueeze(1).expand(-1, 3, -1))
        attended, _ = self.attention(sequence, sequence, sequence)
        return self.net(attended.mean(dim=1) + x)


class Values(Callback):
    """Per optimizer step: which tensors changed value, by name."""

    def __init__(self) -> None:
        self.changed: dict[int, set[str]] = {}
        self._before: dict[str, torch.Tensor] = {}

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._before = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        named = dict(pl_module.named_parameters())
        self.changed[trainer.global_step - 1] = {n for n, b in self._before.items() if not torch.equal(b, named[n])}


@pytest.mark.parametrize("module_type", [Tied, Unused, Groups, Recurrent])
def test_odd_modules_train_only_their_selection_and_get_their_flags_back(module_type: type[TinyNet]) -> None:
    module = module_type()
    callback, values, masks = elastic(profile=synthetic_profile(module)), Values(), Masks()
    tiny_trainer(callbacks=[callback, values, masks], max_epochs=3).fit(module, tiny_data())
    assert [(r.step, r.epoch) for r in callback.history] == [(2, 0), (8, 1), (16, 2)]
    names = [n for n, _ in module.named_parameters()]
    for step, changed in values.changed.items():
        trainable = {n for n, t in zip(names, masks.by_step[step], strict=True) if t}
        assert changed <= trainable, (step, changed - trainable)
    if module_type is Unused:
        assert not any(r.mask[names.index("spare.weight")] for r in callback.history)
    assert all(p.requires_grad for p in module.parameters())


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-true"])
def test_cpu_precisions_select_on_schedule_with_finite_importance(precision: str) -> None:
    callback = elastic()
    tiny_trainer(callbacks=[callback], max_epochs=2, precision=precision).fit(TinyNet(), tiny_data())
    assert [(r.step, r.epoch) for r in callback.history] == [(2, 0), (8, 1)]
    assert all(math.isfinite(v) for r in callback.history for v in r.decision.importance)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"speedup": "2"}, r"`speedup` must be a finite number > 1. Found: '2'"),
        ({"speedup": True}, r"`speedup` must be a finite number > 1. Found: True"),
        ({"speedup": float("nan")}, r"`speedup` must be a finite number > 1. Found: nan"),
        ({"interval": 2.0}, r"`interval` must be a positive int. Found: 2.0"),
        ({"interval": True}, r"`interval` must be a positive int. Found: True"),
        ({"interval_unit": None}, r"`interval_unit` must be one of \('epoch', 'step'\). Found: None"),
        ({"probe_steps": "3"}, r"`probe_steps` must be a positive int or 'auto'. Found: '3'"),
        ({"probe_steps": 0}, r"`probe_steps` must be a positive int or 'auto'. Found: 0"),
        ({"time_model": 1}, r"`time_model` must be one of \('auto', 'measured', 'flops'\). Found: 1"),
        ({"train_never": [""]}, r"`train_never` must be a list of non-empty name patterns. Found: \[''\]"),
        ({"train_always": [1]}, r"`train_always` must be a list of non-empty name patterns. Found: \[1\]"),
        ({"bn_policy": None}, r"`bn_policy` must be one of \('update', 'freeze'\). Found: None"),
        ({"resolution": 10.5}, r"`resolution` must be a positive int of at most 100000. Found: 10.5"),
        ({"profile": 3}, r"`profile` must be a TimingProfile, a path to one saved as JSON, or None. Found: 3"),
        ({"calibrate": "yes"}, r"`calibrate` must be True or False. Found: 'yes'"),
        ({"log_images": 1}, r"`log_images` must be True or False. Found: 1"),
        ({"clock": 0.0}, r"`clock` must be a callable returning seconds. Found: 0.0"),
    ],
)
def test_arguments_of_the_wrong_type_are_refused_by_the_constructor(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ElasticConfigError, match=message):
        ElasticTensorSelection(**kwargs)


class _Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """Ten batches an epoch, of a length Lightning cannot know (no `__len__`)."""

    def __iter__(self) -> Any:
        generator = torch.Generator().manual_seed(0)
        for _ in range(10):
            x = torch.randn(32, 16, generator=generator)
            yield x, x[:, :3].argmax(1)


@pytest.mark.parametrize("calibrate", [False, True])
def test_an_iterable_data_set_of_unknown_length_with_max_epochs_plans_per_interval(calibrate: bool) -> None:
    """Lightning estimates such a fit's steps as `max_steps`, -1 when unset: a fit of unknown length, not of -1 steps
    (which crashed the check before training: a reachable speedup of infinity, rounded)."""
    callback = elastic(calibrate=calibrate, speedup=1.2)
    trainer = tiny_trainer(callbacks=[callback], max_epochs=3)
    trainer.fit(TinyNet(), torch.utils.data.DataLoader(_Stream(), batch_size=None))
    assert trainer.global_step == 30 and callback._fit is not None and callback._fit.plan.total_steps is None
    assert len(callback.history) >= 3  # the first window's, then as each epoch starts


class _BuiltInSetup(TinyNet):
    """Its layers are built in `setup`, as Lightning documents for modules too large to build eagerly."""

    def __init__(self) -> None:
        super().__init__()
        del self.net

    def setup(self, stage: str) -> None:
        self.net = TinyNet().net


class _BuiltInConfigureModel(_BuiltInSetup):
    def setup(self, stage: str) -> None:
        pass

    def configure_model(self) -> None:
        if not hasattr(self, "net"):
            self.net = TinyNet().net


class _LazyMaterialisedInSetup(TinyNet):
    def __init__(self) -> None:
        super().__init__()
        self.net[0] = nn.LazyLinear(64)

    def setup(self, stage: str) -> None:
        self.net(torch.zeros(2, 16))  # what the lazy-module refusal advises


@pytest.mark.parametrize("module_type", [_BuiltInSetup, _BuiltInConfigureModel, _LazyMaterialisedInSetup])
def test_layers_built_in_setup_or_configure_model_are_selected_among(module_type: type[TinyNet]) -> None:
    callback = elastic(profile=None, cache_dir=False, speedup=1.05, time_model="flops")
    module = module_type()
    tiny_trainer(callbacks=[callback], max_epochs=2).fit(module, tiny_data())
    assert callback.timing_profile is not None and len(callback.timing_profile.names) == 10 and callback.history


class _Branchy(L.LightningModule):
    """Layer `a` on even batches, `b` on odd ones: the profiled batch (the first) never reaches `b`."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.a, self.b, self.head = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 3)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = torch.relu(self.stem(x))
        h = torch.relu(self.a(h) if batch_idx % 2 == 0 else self.b(h))
        return nn.functional.cross_entropy(self.head(h), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def test_tensors_of_a_branch_the_profiled_batch_did_not_take_are_said_to_train_outside_the_selection() -> None:
    callback = elastic(profile=None, cache_dir=False, speedup=1.05, time_model="flops")
    with pytest.warns(UserWarning, match=re.escape("did not take): ['b.weight', 'b.bias']. They are not in the profile")):
        tiny_trainer(callbacks=[callback], max_steps=6).fit(_Branchy(), tiny_data())
    assert callback.timing_profile is not None and callback.timing_profile.unused == ("b.weight", "b.bias")
