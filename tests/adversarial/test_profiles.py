"""Profiles that must be taken on the real training step, leave no trace, and never be reused for another model."""

from __future__ import annotations

import json
import logging
import re
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn

from lightning_elastic import ElasticTensorSelection, TimingProfile
from lightning_elastic.errors import ElasticConfigError
from lightning_elastic.profiling import reuse
from lightning_elastic.profiling.cache import device_name
from tests.integration.test_contract import PROFILE, VirtualDevice
from tests.integration.tiny import TinyNet, synthetic_profile, tiny_data, tiny_trainer


def profiling(**kwargs: Any) -> ElasticTensorSelection:
    """The callback profiling for real (no given profile), with no cache: every fit measures."""
    settings: dict[str, Any] = dict(
        speedup=1.6, interval=1, interval_unit="epoch", probe_steps=2, calibrate=False, cache_dir=False
    )
    settings.update(kwargs)
    return ElasticTensorSelection(**settings)


class DtypeSeen(TinyNet):
    """Records the dtype of every input that reaches `training_step`, the profiling passes' included."""

    def __init__(self) -> None:
        super().__init__()
        self.log_of_calls: list[list[torch.dtype]] = [[]]  # one level down: profiling gives lists their items back

    @property
    def seen(self) -> list[torch.dtype]:
        return self.log_of_calls[0]

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        self.seen.append(batch[0].dtype)
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize(("precision", "dtype"), [("bf16-true", torch.bfloat16), ("64-true", torch.float64)])
@pytest.mark.usefixtures("ticking_profiler")
def test_true_precision_profiles_the_converted_batch(precision: str, dtype: torch.dtype) -> None:
    """Profiling goes through the precision plugin's input conversion, as Lightning's own training step does."""
    torch.manual_seed(0)
    module = DtypeSeen()
    callback = profiling(speedup=1.05)  # reachable with the ticking clock: the point is the fit's start
    trainer = tiny_trainer(callbacks=[callback], precision=precision, max_steps=3)
    trainer.fit(module, tiny_data())
    assert trainer.global_step == 3
    assert callback.timing_profile is not None
    assert callback.timing_profile.names == tuple(n for n, _ in module.named_parameters())
    assert len(module.seen) > 3  # the profiling passes ran the training step too
    assert set(module.seen) == {dtype}


@pytest.mark.parametrize(
    ("other", "found"),
    [
        pytest.param(
            lambda: synthetic_profile(TinyNet().net[:6]),
            r"Found: trainable tensors it does not cover: \['net.7.weight', 'net.7.bias'\]",
            id="a subset of the names",
        ),
        pytest.param(
            lambda: synthetic_profile(TinyNet(width=32)),
            r"Found: element counts that differ: \['net.0.weight \(512 elements profiled, 1024 in the module\)'",
            id="other sizes",
        ),
        pytest.param(
            lambda: reshaped(TinyNet()),
            r"Found: shapes that differ: \['net.0.weight \(\(16, 64\) profiled, \(64, 16\) in the module\)'\]$",
            id="a reshaped tensor",
        ),
    ],
)
def test_a_given_profile_of_another_model_is_refused(other: Callable[[], TimingProfile], found: str) -> None:
    """Unprofiled tensors would train outside the budget, and other sizes cost otherwise: refused before training."""
    prof = other()
    if prof.names[0].startswith("0."):
        prof = replace(prof, names=tuple("net." + n for n in prof.names))
    callback = ElasticTensorSelection(speedup=1.6, probe_steps=2, profile=prof, calibrate=False)
    trainer = tiny_trainer(callbacks=[callback], max_steps=3)
    with pytest.raises(ElasticConfigError, match=r"`profile` must describe this module's parameters .*" + found):
        trainer.fit(TinyNet(), tiny_data())
    assert trainer.global_step == 0


def test_a_given_profile_whose_full_step_takes_no_time_is_refused_before_training() -> None:
    """Every share of a step is of `t_full`: a profile of zero times (made by hand) crashed the first step dividing."""
    prof = synthetic_profile(TinyNet())
    zero = replace(prof, t_dw=(0.0,) * len(prof.names), t_dy=(0.0,) * len(prof.names), t_fw=0.0, t_full=0.0)
    trainer = tiny_trainer(callbacks=[ElasticTensorSelection(profile=zero, calibrate=False)], max_steps=3)
    with pytest.raises(ElasticConfigError, match=r"`profile` must time a full step of more than 0 seconds .* Found: `t_full` 0.0$"):
        trainer.fit(TinyNet(), tiny_data())
    assert trainer.global_step == 0


def reshaped(module: TinyNet) -> TimingProfile:
    """The profile of `module` with its first weight transposed (a Linear(64, 16) there): the same element count."""
    shapes = [tuple(p.shape) for p in module.parameters()]
    shapes[0] = shapes[0][::-1]
    return replace(synthetic_profile(module), shapes=tuple(shapes))


def test_a_given_profile_file_in_an_older_format_is_refused_saying_so(tmp_path: Path) -> None:
    """A file of format 1 (before `shapes`) cannot say which shapes it describes: refused as training starts, with
    what to do. Before, its element counts alone were checked."""
    data = {**synthetic_profile(TinyNet()).to_dict(), "version": 1}
    del data["shapes"]
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data))
    callback = ElasticTensorSelection(speedup=1.6, probe_steps=2, profile=path, calibrate=False)
    trainer = tiny_trainer(callbacks=[callback], max_steps=3)
    message = (
        "`profile` must be a timing profile written in this version's file format (2): profile the model again, or "
        f"leave `profile` unset and the fit profiles it. Found: {str(path)!r} (`data[\"version\"]` must be 2. Found: 1)"
    )
    with pytest.raises(ElasticConfigError, match=re.escape(message)):
        trainer.fit(TinyNet(), tiny_data())
    assert trainer.global_step == 0


class Activated(TinyNet):
    """TinyNet whose activations are a functional op that can change between fits, parameters untouched."""

    def __init__(self) -> None:
        super().__init__()
        self.activation: Callable[[Tensor], Tensor] = torch.relu

    def forward(self, x: Tensor) -> Tensor:
        h = x
        for layer in self.net:
            h = self.activation(h) if isinstance(layer, nn.ReLU) else layer(h)
        return h


@pytest.mark.usefixtures("ticking_profiler")
def test_the_previous_fits_profile_is_kept_for_the_same_step_and_measured_again_for_a_changed_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    torch.manual_seed(0)
    module = Activated()
    callback = profiling(speedup=1.05)
    tiny_trainer(callbacks=[callback], max_steps=2).fit(module, tiny_data())
    first = callback.timing_profile
    tiny_trainer(callbacks=[callback], max_steps=2).fit(module, tiny_data())
    assert callback.timing_profile is first  # the same step: no profiling again

    module.activation = torch.tanh
    with caplog.at_level(logging.INFO):
        tiny_trainer(callbacks=[callback], max_steps=2).fit(module, tiny_data())
    assert callback.timing_profile is not first and callback.timing_profile is not None
    assert callback.timing_profile.fingerprint != first.fingerprint
    assert (
        "the previous fit's timing profile does not describe this model (it was taken of another training step: its "
        "graph, the shapes or dtypes of its inputs or parameters, or the torch version differ); profiling again."
    ) in caplog.text


OTHER_STEP = (
    "ElasticTensorSelection: the given `profile` does not match this fit's training step ({}). It is used as given: "
    "its times may be off for this step; the step times the fit measures correct the plan's totals, not how the "
    "tensors' costs compare. Leave `profile` unset to profile this step (or read its cached profile)."
)


class WarnedBeforeTraining(Callback):
    """The warnings caught (in `caught`) when the first training batch starts."""

    def __init__(self, caught: list[warnings.WarningMessage]) -> None:
        self.caught = caught
        self.before: list[str] | None = None

    def on_train_batch_start(self, *args: Any) -> None:
        if self.before is None:
            self.before = [str(w.message) for w in self.caught]


def measured(model: type[TinyNet]) -> tuple[TinyNet, TimingProfile]:
    """A seeded `model` and the profile a short fit measured of it."""
    torch.manual_seed(0)
    module = model()
    measuring = profiling(speedup=1.05)
    tiny_trainer(callbacks=[measuring], max_steps=2).fit(module, tiny_data())
    assert measuring.timing_profile is not None
    return module, measuring.timing_profile


def fit_given(module: TinyNet, prof: TimingProfile) -> tuple[ElasticTensorSelection, list[str]]:
    """A fit of `module` given `prof`, and what it warned about its profile before the first batch (it warns of
    nothing else after)."""
    callback = profiling(speedup=1.05, profile=prof)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        watch = WarnedBeforeTraining(caught)
        tiny_trainer(callbacks=[callback, watch], max_steps=2).fit(module, tiny_data())
    said = [str(w.message) for w in caught if "`profile`" in str(w.message)]
    assert watch.before is not None and [m for m in watch.before if "`profile`" in m] == said
    return callback, said


@pytest.mark.usefixtures("ticking_profiler")
def test_a_given_profile_of_another_step_over_the_same_parameters_is_said_before_training_and_used() -> None:
    """Same names and shapes, another graph (relu made tanh): the profile's times are another step's. Said before
    the first batch and used as given (the user asked for it). Before: used without a word."""
    module, prof = measured(Activated)
    module.activation = torch.tanh
    callback, said = fit_given(module, prof)
    step = (
        "it was taken of another training step: its graph, the shapes or dtypes of its inputs or parameters, or the "
        "torch version differ"
    )
    assert said == [OTHER_STEP.format(step)]
    assert callback.timing_profile is prof


@pytest.mark.usefixtures("ticking_profiler")
def test_a_given_profile_of_this_step_is_used_without_a_word() -> None:
    module, prof = measured(Activated)
    callback, said = fit_given(module, prof)
    assert said == []
    assert callback.timing_profile is prof


def test_a_given_profile_taken_on_another_kind_of_device_is_refused_before_training() -> None:
    """A GPU's profile in a CPU fit: its per-tensor costs say nothing of this device's. Before: a warning, and used."""
    module = TinyNet()
    prof = replace(synthetic_profile(module), device="cuda (NVIDIA H100)")
    before = [p.detach().clone() for p in module.parameters()]
    with pytest.raises(
        ElasticConfigError,
        match=r"^`profile` must be taken on the kind of device this fit trains on \(cpu\): profile the model on it, or "
        r"leave `profile` unset and the fit profiles it\. Found: a profile taken on cuda \(NVIDIA H100\)$",
    ):
        tiny_trainer(callbacks=[profiling(speedup=1.05, profile=prof)], max_steps=2).fit(module, tiny_data())
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))


@pytest.mark.usefixtures("ticking_profiler")
def test_a_given_profile_taken_with_another_thread_count_names_both_devices() -> None:
    threads = torch.get_num_threads()
    torch.manual_seed(0)
    module = Activated()
    measuring = profiling(speedup=1.05)
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        tiny_trainer(callbacks=[measuring], max_steps=2).fit(module, tiny_data())
        taken = device_name(torch.device("cpu"))
    finally:
        torch.set_num_threads(threads)
    prof = measuring.timing_profile
    assert prof is not None and prof.device == taken
    _, said = fit_given(module, prof)
    assert said == [OTHER_STEP.format(f"it was taken on {taken}, this fit runs on {device_name(torch.device('cpu'))}")]


def test_the_check_of_a_given_profile_leaves_no_trace_and_is_charged_to_the_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The check's forward and backward pass changes nothing the fit computes: with it, the fit's weights, buffers
    and selections are bit-identical to a fit without it. Its seconds are charged to the fit with its start (here the
    simulated device's clock moves 100 s while it runs)."""
    settings: dict[str, Any] = dict(speedup=1.5, interval=4, interval_unit="step", probe_steps=2)
    own = reuse.step_difference

    def fit(check_seconds: float | None) -> tuple[ElasticTensorSelection, TinyNet]:
        """A fit given the synthetic `PROFILE` on the simulated device: without the check (None), or with it taking
        `check_seconds` of the device's clock."""
        device = VirtualDevice(1.0)

        def check(*args: Any) -> str | None:
            if check_seconds is None:
                return None
            device.now += check_seconds
            return own(*args)

        monkeypatch.setattr(reuse, "step_difference", check)
        callback = ElasticTensorSelection(profile=PROFILE, clock=device.clock, **settings)
        torch.manual_seed(0)
        module = TinyNet()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*the given `profile` does not match")  # a synthetic profile
            tiny_trainer(callbacks=[device, callback], max_steps=12, max_epochs=-1).fit(module, tiny_data())
        return callback, module

    unchecked, plain = fit(None)
    checked, module = fit(0.0)
    assert [r.mask for r in checked.history] == [r.mask for r in unchecked.history] and len(checked.history) >= 2
    after, without = module.state_dict(), plain.state_dict()
    assert all(torch.equal(after[name], without[name]) for name in without)  # weights, BatchNorm statistics
    slow, _ = fit(100.0)
    assert slow.summary()["profile_seconds"] == pytest.approx(checked.summary()["profile_seconds"] + 100.0)
