"""ElasticTensorSelection in a real Trainer: what trains when, probes, pins, refusals, precision, logging."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger, TensorBoardLogger

from lightning_elastic import ElasticTensorSelection
from lightning_elastic.errors import ElasticConfigError
from tests.integration.tiny import TinyNet, synthetic_profile, tiny_data, tiny_trainer


class Recorder(Callback):
    """Per optimizer step: which tensors required grad, and which changed value."""

    def __init__(self) -> None:
        self.trainable: list[tuple[bool, ...]] = []
        self.changed: list[tuple[bool, ...]] = []
        self.steps: list[int] = []
        self._before: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        self._before = [p.detach().clone() for p in pl_module.parameters()]
        self.steps.append(trainer.global_step)
        self.trainable.append(tuple(p.requires_grad for p in pl_module.parameters()))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.changed.append(
            tuple(not torch.equal(b, p) for b, p in zip(self._before, pl_module.parameters(), strict=True))
        )


PROFILE = synthetic_profile(TinyNet())


def elastic(**kwargs: Any) -> ElasticTensorSelection:
    """The callback with a fixed timing profile and no calibration: decisions depend on importance alone."""
    settings: dict[str, Any] = dict(
        speedup=1.6, interval=4, interval_unit="step", probe_steps=2, profile=PROFILE, calibrate=False
    )
    settings.update(kwargs)
    return ElasticTensorSelection(**settings)


def fit(callbacks: list[Callback], module: L.LightningModule | None = None, **trainer_kwargs: Any) -> TinyNet:
    module = module or TinyNet()
    tiny_trainer(callbacks=callbacks, **trainer_kwargs).fit(module, tiny_data())
    return module  # type: ignore[return-value]


def test_only_selected_tensors_train_and_selections_change() -> None:
    callback = elastic()
    recorder = Recorder()
    fit([callback, recorder], max_epochs=4)
    assert len(callback.history) >= 5
    for trainable, changed in zip(recorder.trainable, recorder.changed, strict=True):
        assert all(t or not c for t, c in zip(trainable, changed, strict=True)), "a frozen tensor changed"
    # probe windows train everything; selections train a strict subset; no window opens for a selection at the
    # fit's end (step 32), so steps 30 and 31 train the selection of step 28
    in_window = [s < 2 or (s % 4 >= 2 and s < 30) for s in recorder.steps]
    probe = [t for w, t in zip(in_window, recorder.trainable, strict=True) if w]
    selected = [t for w, t in zip(in_window, recorder.trainable, strict=True) if not w]
    assert all(all(t) for t in probe)
    assert selected and all(not all(t) for t in selected)
    masks = {r.mask for r in callback.history}
    assert any(callback.history[-1].mask)
    summary = callback.summary()
    assert summary["selections"] == len(callback.history)
    assert 0 < summary["selected_fraction"] < 1
    assert len(masks) >= 1


@pytest.mark.usefixtures("ticking_profiler")  # profiled for real, at 1.05
def test_probe_steps_are_ordinary_training_steps() -> None:
    """Until the first selection, training with the callback is bit-identical to training without it."""
    torch.manual_seed(1)
    plain = TinyNet(optimizer="adamw")
    elastic_module = copy.deepcopy(plain)
    fit([], module=plain, max_steps=3)
    torch.manual_seed(0)
    fit(
        # calibrate=False: a 3-step fit of probe steps alone cannot keep a wall-clock contract (refused otherwise)
        [ElasticTensorSelection(speedup=1.05, interval=10, interval_unit="step", probe_steps=3, calibrate=False)],
        module=elastic_module,
        max_steps=3,
    )
    for a, b in zip(plain.parameters(), elastic_module.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(plain.buffers(), elastic_module.buffers(), strict=True):
        assert torch.equal(a, b)


def test_pins_are_respected() -> None:
    callback = elastic(train_always=["net.7.*"], train_never=["net.0.*"])
    recorder = Recorder()
    module = TinyNet()
    names = [n for n, _ in module.named_parameters()]
    fit([callback, recorder], module=module, max_epochs=2)
    head = [names.index("net.7.weight"), names.index("net.7.bias")]
    first = [names.index("net.0.weight"), names.index("net.0.bias")]
    for trainable in recorder.trainable:
        assert all(trainable[i] for i in head)
        assert not any(trainable[i] for i in first)


def test_unreachable_speedup_fails_before_training_with_the_largest_reachable() -> None:
    recorder = Recorder()
    with pytest.raises(
        ElasticConfigError, match=r"`speedup` must be at most \d+\.\d\d for this model on this device.*Found: 50"
    ):
        fit([elastic(speedup=50, train_always=["net.0.weight"]), recorder])
    assert recorder.steps == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"speedup": 1.0}, r"`speedup` must be a finite number > 1. Found: 1.0"),
        ({"speedup": float("inf")}, r"`speedup` must be a finite number > 1. Found: inf"),
        ({"interval": 0}, r"`interval` must be a positive int. Found: 0"),
        ({"interval_unit": "batch"}, r"`interval_unit` must be one of \('epoch', 'step'\). Found: 'batch'"),
        ({"probe_steps": -1}, r"`probe_steps` must be a positive int or 'auto'. Found: -1"),
        ({"time_model": "guess"}, r"`time_model` must be one of \('auto', 'measured', 'flops'\). Found: 'guess'"),
        ({"bn_policy": "off"}, r"`bn_policy` must be one of \('update', 'freeze'\). Found: 'off'"),
        ({"units": "block"}, r"`units` must be one of \('layer', 'tensor'\). Found: 'block'"),
        ({"train_always": "fc.*"}, r"`train_always` must be a list of non-empty name patterns. Found: 'fc.\*'"),
        ({"train_never": 5}, r"`train_never` must be a list of non-empty name patterns. Found: 5"),
        ({"resolution": 0}, r"`resolution` must be a positive int of at most 100000. Found: 0"),
    ],
)
def test_constructor_rejects_bad_arguments(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ElasticTensorSelection(**kwargs)


def test_constructor_lists_every_problem_at_once() -> None:
    with pytest.raises(ValueError, match=r"`speedup`.*; `interval`.*; `bn_policy`"):
        ElasticTensorSelection(speedup=0.5, interval=0, bn_policy="x")  # type: ignore[arg-type]


def test_patterns_matching_nothing_are_refused() -> None:
    with pytest.raises(ElasticConfigError, match=r"`train_always` patterns must each match .*\['head\.\*'\]"):
        fit([elastic(train_always=["head.*"])])


def test_probe_window_longer_than_the_period_is_refused() -> None:
    with pytest.raises(
        ValueError, match=r"`probe_steps` must be fewer than the optimizer steps between two selections"
    ):
        fit([elastic(interval=1, interval_unit="epoch", probe_steps=50)])


def test_fast_dev_run_too_short_for_the_schedule_trains_everything() -> None:
    """fast_dev_run=True (one step) cannot hold a probe window and a selection: the callback steps aside."""
    callback, recorder = elastic(interval=1, interval_unit="epoch", probe_steps=2), Recorder()
    fit([callback, recorder], fast_dev_run=True)
    assert recorder.steps == [0] and all(recorder.trainable[0]) and any(recorder.changed[0])
    assert callback.history == () and callback.summary()["selections"] == 0


def test_fast_dev_run_long_enough_for_the_schedule_selects() -> None:
    callback, recorder = elastic(probe_steps=1, interval=3), Recorder()
    fit([callback, recorder], fast_dev_run=3)
    # step 0 probes and is followed by a selection that trains steps 1 and 2: no window opens for a selection at
    # the fit's end (step 3), which nothing would train
    assert [r.step for r in callback.history] == [1]
    assert all(recorder.trainable[0]) and not all(recorder.trainable[1]) and not all(recorder.trainable[2])


def test_fast_dev_run_runs_on_with_a_speedup_out_of_reach_and_says_so() -> None:
    """A smoke run is a few steps to see that the code runs, too few for any contract: refusing its speedup stopped
    `fast_dev_run` at the default 2x (3 steps with a full-cost probe step reach at most 1.66x)."""
    callback, recorder = elastic(probe_steps=1, interval=3, speedup=50.0), Recorder()
    with pytest.warns(UserWarning, match=r"not refused under `fast_dev_run`, which runs on: `speedup` must be at most"):
        fit([callback, recorder], fast_dev_run=3)
    assert recorder.steps == [0, 1, 2] and [r.step for r in callback.history] == [1]
    with pytest.raises(ElasticConfigError, match=r"`speedup` must be at most"):  # refused in a real fit
        fit([elastic(probe_steps=1, interval=3, speedup=50.0)], max_steps=3)


class ManualNet(TinyNet):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


class TwoOptimizers(TinyNet):
    def configure_optimizers(self) -> Any:
        return [torch.optim.SGD(self.net[:4].parameters(), lr=0.1), torch.optim.SGD(self.net[4:].parameters(), lr=0.1)]


def test_unsupported_modules_are_refused_at_setup() -> None:
    with pytest.raises(ValueError, match=r"needs automatic optimization"):
        fit([ElasticTensorSelection()], module=ManualNet())
    frozen = TinyNet()
    frozen.requires_grad_(False)
    with pytest.raises(ValueError, match=r"needs a model with trainable parameters. Found: none"):
        fit([ElasticTensorSelection()], module=frozen)


def test_several_optimizers_are_refused() -> None:
    """Automatic optimization (which the callback needs) allows one optimizer: Lightning itself refuses more."""
    with pytest.raises(RuntimeError, match=r"multiple optimizers is only supported with manual optimization"):
        fit([elastic()], module=TwoOptimizers())


class Lbfgs(TinyNet):
    def configure_optimizers(self) -> Any:
        return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=3)


class Twice(torch.optim.SGD):
    """An optimizer of its own that evaluates the closure twice a step (a line search, as LBFGS does)."""

    def step(self, closure: Any = None) -> Any:
        closure()
        return super().step(closure)


def test_an_optimizer_that_runs_the_training_step_more_than_once_a_step_is_refused_not_a_crash_inside() -> None:
    """LBFGS crashed the evaluator's order check at its second closure, after it had moved the weights: refused as
    the fit starts, by type; another optimizer that re-evaluates its closure, at its second evaluation."""
    module, recorder = Lbfgs(), Recorder()
    before = [p.detach().clone() for p in module.parameters()]
    with pytest.raises(ElasticConfigError, match=r"needs an optimizer that runs the training step once per .* Found: LBFGS$"):
        fit([elastic(), recorder], module=module)
    assert recorder.steps == [] and all(torch.equal(a, p) for a, p in zip(before, module.parameters(), strict=True))

    class Repeating(TinyNet):
        def configure_optimizers(self) -> Any:
            return Twice(self.parameters(), lr=0.05)

    with pytest.raises(ElasticConfigError, match=r"Found: a second training step within one optimizer step$"):
        fit([elastic()], module=Repeating())


def test_an_optimizer_step_that_runs_the_closure_alone_on_some_batches_is_a_step_without_an_update() -> None:
    """Lightning's pattern of stepping every other batch (`optimizer_step` runs `optimizer_closure()` alone on the
    others) advances the step count with no update: it crashed the evaluator ("after_step() without before_step()")."""

    class EveryOther(TinyNet):
        def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
            if batch_idx % 2 == 0:
                optimizer.step(closure=optimizer_closure)
            else:
                optimizer_closure()

    callback, plain = elastic(), elastic()
    fit([callback], module=EveryOther(), max_epochs=3)
    fit([plain], max_epochs=3)
    assert [r.step for r in callback.history] == [r.step for r in plain.history] == [4, 8, 12, 16, 20]
    assert callback.report().steps == plain.report().steps == 24


def test_epoch_mode_selects_as_epochs_start() -> None:
    callback = elastic(interval=1, interval_unit="epoch")
    fit([callback], max_epochs=3)  # 8 optimizer steps per epoch
    assert [(r.step, r.epoch) for r in callback.history] == [(2, 0), (8, 1), (16, 2)]


def test_gradient_accumulation_counts_optimizer_steps() -> None:
    callback = elastic()
    recorder = Recorder()
    fit([callback, recorder], max_epochs=2, accumulate_grad_batches=2)
    # 8 optimizer steps: the window [2, 4) would overwrite a selection at step 2 before it trains, so the first
    # window runs on to step 4; no window for a selection at the end
    assert [r.step for r in callback.history] == [4]
    for trainable, changed in zip(recorder.trainable, recorder.changed, strict=True):
        assert all(t or not c for t, c in zip(trainable, changed, strict=True))


def test_bf16_mixed_precision_measures_finite_importance() -> None:
    callback = elastic()
    fit([callback], max_epochs=1, precision="bf16-mixed")
    assert callback.history
    assert all(torch.isfinite(torch.tensor(r.decision.importance)).all() for r in callback.history)


def test_gradient_clipping_and_lr_scheduler() -> None:
    class Scheduled(TinyNet):
        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=3)]

    callback = elastic()
    recorder = Recorder()
    fit([callback, recorder], module=Scheduled(), max_epochs=1, gradient_clip_val=0.5)
    # the first window runs on to step 4 (a selection at 2 would not train a step); none for the fit's end (step 8)
    assert [r.step for r in callback.history] == [4]
    for trainable, changed in zip(recorder.trainable, recorder.changed, strict=True):
        assert all(t or not c for t, c in zip(trainable, changed, strict=True))


def test_bn_policy_freeze_keeps_frozen_statistics() -> None:
    callback = elastic(interval=50, bn_policy="freeze", train_never=["net.1.*"])
    module = TinyNet()
    stats: list[torch.Tensor] = []
    modes: list[bool] = []

    class Watch(Callback):
        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
            stats.append(module.net[1].running_mean.clone())
            modes.append(module.net[1].training)

    fit([callback, Watch()], module=module, max_steps=6)
    assert modes[2:] == [False] * 4  # in eval mode from the first selection on (after step 2)
    assert torch.equal(stats[2], stats[-1])  # frozen from the first selection on (after step 2)
    assert module.net[1].training  # the user's mode is given back when the fit ends


class ListLogger(Logger):
    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "list"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.metrics.append((step or 0, dict(metrics)))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        return None


def test_metrics_reach_every_logger_and_tensorboard(tmp_path: Path) -> None:
    callback = elastic()
    memory = ListLogger()
    board = TensorBoardLogger(tmp_path)
    fit([callback], max_epochs=2, logger=[memory, board])
    logged = [m for _, m in memory.metrics if "elastic/selected_fraction" in m]
    assert len(logged) == len(callback.history)
    for metrics, record in zip(logged, callback.history, strict=True):
        assert metrics["elastic/selected_fraction"] == record.mask.count(True) / len(record.mask)
        assert metrics["elastic/predicted_step_ms"] == pytest.approx(record.decision.predicted_seconds * 1e3)
    assert any("elastic/measured_speedup" in m for _, m in memory.metrics)
    # an interval's figures at its last step, the next selection's at the step it comes into force: never two values
    # of one metric at one step (the chart of predicted against measured steps jumped at every selection)
    seen: dict[tuple[int, str], float] = {}
    for step, metrics in memory.metrics:
        for name, value in metrics.items():
            if name.startswith("elastic/"):
                assert seen.setdefault((step, name), value) == value, (step, name)
    closed = [step for step, m in memory.metrics if "elastic/measured_step_ms" in m]
    last = callback.report().steps - 1  # the fit's last interval closes as it ends
    assert closed and all(step + 1 in {r.step for r in callback.history} or step == last for step in closed), closed
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(board.log_dir), size_guidance={"images": 0, "tensors": 0, "histograms": 0})
    events.Reload()
    images = events.Images("elastic/selection")  # at selections within the maps' share, and as the fit ends
    assert images and {i.step for i in images[:-1]} <= {r.step for r in callback.history}
    assert "elastic/importance" in events.Tags()["histograms"]
    assert {"elastic/profile/text_summary", "elastic/selection/text_summary"} <= set(events.Tags()["tensors"])
    # the selection map: the last image is the whole fit's map, at its bounded size
    image = callback.selection_map()
    assert image is not None and image.shape[1] >= 560
    assert (images[-1].height, images[-1].width) == image.shape[:2]
    # the selection in words, with the names of the trained tensors, once per selection
    texts = events.Tensors("elastic/selection/text_summary")
    assert len(texts) == len(callback.history)
    names = callback.timing_profile.names if callback.timing_profile else ()
    for event, record in zip(texts, callback.history, strict=True):
        text = event.tensor_proto.string_val[0].decode()
        assert all(name in text for name in record.mask.trained(names))
    # the charts of the Custom Scalars tab
    from tensorboard.plugins.custom_scalar import layout_pb2

    layout = layout_pb2.Layout()
    layout.ParseFromString(events.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    charts = {chart.title: list(chart.multiline.tag) for c in layout.category for chart in c.chart}
    assert charts["wall-clock contract: planned vs spent (s)"] == ["elastic/planned_seconds", "elastic/spent_seconds"]
    assert len(charts) == 4
    # the importance of the top tensors, tagged by name
    top = max(range(len(names)), key=lambda k: callback.history[-1].decision.importance[k])
    assert f"elastic/importance/{names[top]}" in events.Tags()["scalars"]


class ProgressBarReader(Callback):
    """What the progress bar shows at each batch start (after the callback's hook: the figures of this step)."""

    def __init__(self) -> None:
        self.seen: list[dict[str, float]] = []

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.seen.append({k: float(v) for k, v in trainer.progress_bar_metrics.items()})


def test_progress_bar_shows_the_phase_and_the_trained_share() -> None:
    callback, reader, recorder = elastic(), ProgressBarReader(), Recorder()
    fit([callback, reader, recorder], max_epochs=2)
    assert len(reader.seen) == len(recorder.trainable) == 16
    for bar, trainable in zip(reader.seen, recorder.trainable, strict=True):
        probing = all(trainable)  # the tiny model's selections never train every tensor
        assert bar["elastic/probing"] == float(probing)
        assert bar["elastic/trained"] == pytest.approx(sum(trainable) / len(trainable))


def test_the_summary_of_a_fit_without_the_contract_judges_no_contract(caplog: pytest.LogCaptureFixture) -> None:
    uncalibrated = elastic()
    with caplog.at_level("INFO"):
        fit([uncalibrated], max_epochs=2)
    assert uncalibrated.report().headline().endswith("x per selected step: `calibrate=False` keeps no whole-fit contract)")
    assert uncalibrated.report().shortfall == "" and "why not met" not in caplog.text
    assert "keeps no whole-fit contract" in caplog.text  # the table the fit ends with


def test_a_selection_without_a_window_reads_the_frozen_tensors_fallen_as_the_trained_ones_fell() -> None:
    """Between windows only the trained tensors are measured. Reference from the selection records alone: at a
    selection that no window precedes, each tensor frozen in the interval before reads its earlier importance times
    the median ratio, new over earlier, of the tensors trained in that interval (the pinned head left out)."""
    callback = elastic(probe_steps="auto", interval=6, train_always=["net.7.*"])
    module = TinyNet(optimizer="adam", lr=0.01)
    tiny_trainer(callbacks=[callback], max_steps=96, max_epochs=-1).fit(module, tiny_data(samples=512))
    fit = callback._fit
    assert fit is not None
    history = [r for r in callback.history if not r.replanned]
    unprobed = [(a, b) for a, b in itertools.pairwise(history) if not fit.schedule.probed(b.step)]
    assert len(unprobed) >= 5  # the first window alone (3% of the fit), then selections that re-use what trained
    checked = 0
    for before, after in unprobed:
        old, new = before.decision.importance, after.decision.importance
        trained = [k for k, on in enumerate(before.mask) if on and not fit.required[k] and old[k] > 0 and new[k] > 0]
        ratios = sorted(new[k] / old[k] for k in trained)
        fall = (ratios[(len(ratios) - 1) // 2] + ratios[len(ratios) // 2]) / 2
        frozen = [k for k, on in enumerate(before.mask) if not on and not fit.forbidden[k]]
        assert [new[k] for k in frozen] == pytest.approx([old[k] * fall for k in frozen], rel=1e-9)
        checked += len(frozen) * (fall != pytest.approx(1.0))
    assert checked > 0  # frozen tensors were read fallen, not as measured


@pytest.mark.parametrize("units", ["layer", "tensor"])
def test_selections_train_a_layer_with_its_batchnorm_unless_units_are_tensors(units: str) -> None:
    """TinyNet's first Linear and its BatchNorm (tensors 0-3) are one unit by default: every selection trains all
    four or none of them. Selected by tensors under AdamW, the four part in some selection of this fit (measured:
    '1010', the weights without their biases)."""
    callback = elastic(units=units, speedup=1.2)
    fit([callback], module=TinyNet(optimizer="adamw"), max_epochs=4)
    assert len(callback.history) >= 5
    apart = [record.mask[:4] for record in callback.history if len(set(record.mask[:4])) > 1]
    assert (apart == []) == (units == "layer"), apart
