"""The baselines' freezing policies: which tensors each trains, checked against the model's real layers."""

from __future__ import annotations

import itertools
import json
import math
import random
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import BackboneFinetuning
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from elastic_zoo import baselines, method
from elastic_zoo.baselines import (
    LinearFreeze,
    TrainOnly,
    attach_backbone,
    bitfit,
    freeze_fraction,
    head_only,
    last_k_within_budget,
    layers_from_input,
    train_only,
)
from elastic_zoo.method import StaticLastK
from elastic_zoo.models import efficientnet_lite0, tiny_cnn
from elastic_zoo.module import ImageClassifier
from lightning_elastic import warmup
from lightning_elastic.errors import SpeedupOutOfReach
from lightning_elastic.profiling import TimingProfile
from lightning_elastic.time_model import StepTimeModel
from tests.integration.tiny import tiny_trainer


def test_bitfit_on_lite0_trains_exactly_the_head_and_the_batchnorm_layers() -> None:
    module = ImageClassifier(efficientnet_lite0(num_classes=4, pretrained=False), num_classes=4)
    # Reference: Lite0's convolutions have no bias, so BitFit is every BatchNorm parameter plus the new head.
    norms = {
        f"{prefix}.{name}"
        for prefix, layer in module.named_modules()
        if isinstance(layer, nn.BatchNorm2d)
        for name, _ in layer.named_parameters()
    }
    assert set(bitfit(module, ["model._fc.*"])) == norms | {"model._fc.weight", "model._fc.bias"}
    assert head_only(module, ["model._fc.*"]) == ["model._fc.weight", "model._fc.bias"]


def test_bitfit_adds_the_biases_of_layers_that_have_them() -> None:
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.LayerNorm(4), nn.Linear(4, 4, bias=False), nn.Linear(4, 2))
    assert bitfit(net, ["3.*"]) == ["0.bias", "1.weight", "1.bias", "3.weight", "3.bias"]
    with pytest.raises(
        ValueError, match=r"`head` patterns must each match .* Found patterns matching nothing: \['fc\.\*'\]"
    ):
        head_only(net, ["fc.*"])


def _random_profile(n: int, rng: random.Random) -> TimingProfile:
    return TimingProfile(
        names=tuple(f"t{i}" for i in range(n)),
        t_dw=tuple(rng.uniform(0.1, 2.0) for _ in range(n)),
        t_dy=(0.0, *(rng.uniform(0.0, 2.0) for _ in range(n - 1))),
        t_fw=rng.uniform(1.0, 5.0),
        t_full=10.0,
        device="cpu",
        fingerprint="f",
        unused=(),
        method="measured",
        numel=(1,) * n,
    )


@pytest.mark.parametrize("seed", range(20))
def test_last_k_is_the_longest_suffix_that_fits_the_budget(seed: int) -> None:
    rng = random.Random(seed)
    prof = _random_profile(rng.randint(2, 9), rng)
    model = StepTimeModel.from_profile(prof)
    n, speedup = len(prof.names), rng.uniform(1.1, 2.5)
    head = [prof.names[-1]]
    limit = model.full / speedup
    # Brute force over every suffix length: the longest one (with the head) predicted within the budget.
    fitting = [k for k in range(1, n + 1) if model.predict([i >= n - k for i in range(n)]) <= limit]
    if not fitting:
        with pytest.raises(ValueError, match=r"`speedup` must be at most .* Found: "):
            last_k_within_budget(prof, speedup, head)
        return
    assert last_k_within_budget(prof, speedup, head) == list(prof.names[n - max(fitting) :])


@pytest.mark.parametrize("seed", range(20))
def test_last_k_under_a_calibrated_model_is_the_longest_suffix_its_steps_fit(seed: int) -> None:
    """A real step pays an update and a loop besides the profiled pass: under the model calibrated to it, the suffix
    is the longest whose step fits that model's full step over the speedup (brute force), never a longer one than
    under the pass alone."""
    rng = random.Random(seed)
    prof = _random_profile(rng.randint(2, 9), rng)
    step, update = prof.t_full * rng.uniform(1.0, 1.5), rng.uniform(0.0, 0.1 * prof.t_full)
    model = StepTimeModel.calibrated(prof, full_step=step + update, optimizer_seconds=update)
    n, speedup, head = len(prof.names), rng.uniform(1.1, 2.5), [prof.names[-1]]
    fitting = [k for k in range(1, n + 1) if model.predict([i >= n - k for i in range(n)]) <= model.full / speedup]
    if not fitting:
        with pytest.raises(ValueError, match=r"`speedup` must be at most .* Found: "):
            last_k_within_budget(prof, speedup, head, model)
        return
    chosen = last_k_within_budget(prof, speedup, head, model)
    assert chosen == list(prof.names[n - max(fitting) :])
    assert len(chosen) <= len(last_k_within_budget(prof, speedup, head))


@pytest.mark.parametrize("guided", [0, 2, baselines.GUIDED_PROBES])
@pytest.mark.parametrize("seed", range(30))
def test_the_measured_choice_is_the_largest_candidate_whose_timed_step_fits(seed: int, guided: int) -> None:
    """Against brute force: whatever the model's error (a partial step dearer or cheaper than it predicts, in any
    shape, or timed steps that do not follow the model at all), the search returns the last candidate whose timed
    step fits, timing none twice and at most `guided` + log2(candidates) of them, or refuses with the head's timed
    figure when none fits."""
    rng = random.Random(seed)
    prof = _random_profile(rng.randint(2, 40), rng)
    sets = baselines.suffix_sets(prof, head=[prof.names[-1]] if rng.random() < 0.5 else [])
    model = StepTimeModel.from_profile(prof)
    full_step = rng.uniform(1.0, 10.0)
    if seed % 2:  # a monotone distortion of the model's prediction, with a fixed cost of its own
        power, fixed = rng.uniform(0.5, 2.0), rng.uniform(0.0, 0.4)
        costs = [full_step * (fixed + (1 - fixed) * (model.predict(m) / model.full) ** power) for m in sets]
    else:  # growing with the candidate, in steps the model knows nothing of
        costs = list(itertools.accumulate(rng.uniform(0.0, 1.0) for _ in sets))
        costs = [full_step * c / costs[-1] for c in costs]
    costs[-1] = full_step
    speedup = rng.uniform(1.05, 4.0)
    probed: list[int] = []

    def timed(mask: tuple[bool, ...]) -> float:
        probed.append(sets.index(mask))
        return costs[sets.index(mask)]

    fits = [i for i, cost in enumerate(costs) if cost <= full_step / speedup]
    if not fits:
        with pytest.raises(SpeedupOutOfReach, match=r"^`speedup` must be at most [0-9.]+ for a static selection") as e:
            baselines.last_k_by_measured_steps(sets, timed, full_step, speedup, model, guided)
        assert e.value.reachable == math.floor(full_step / costs[0] * 100) / 100 < speedup
        return
    assert baselines.last_k_by_measured_steps(sets, timed, full_step, speedup, model, guided) == fits[-1]
    assert len(probed) == len(set(probed)) <= guided + math.ceil(math.log2(len(sets)))


@pytest.mark.parametrize("seed", range(20))
def test_with_noisy_timings_the_choice_was_timed_within_the_budget_and_the_next_over_it(seed: int) -> None:
    """Timings that do not grow with the candidate (the noise of a busy machine): the answer is a candidate timed
    within the budget whose next one was timed over it (or is every tensor, a full step), each timed once."""
    rng = random.Random(seed)
    prof = _random_profile(rng.randint(2, 40), rng)
    sets = baselines.suffix_sets(prof)
    costs = [rng.uniform(0.2, 1.0) for _ in sets]
    probed: list[int] = []

    def timed(mask: tuple[bool, ...]) -> float:
        probed.append(sets.index(mask))
        return costs[sets.index(mask)]

    try:
        chosen = baselines.last_k_by_measured_steps(sets, timed, 1.0, 1.6, StepTimeModel.from_profile(prof))
    except SpeedupOutOfReach:
        assert probed[-1] == 0 and costs[0] > 1 / 1.6  # refused only on the head's own timing
        return
    assert chosen in probed and costs[chosen] <= 1 / 1.6
    assert chosen + 1 == len(sets) - 1 or (chosen + 1 in probed and costs[chosen + 1] > 1 / 1.6)
    assert len(probed) == len(set(probed))


def test_a_single_candidate_is_a_full_step_refused_untimed_and_a_full_step_must_be_positive() -> None:
    prof = TimingProfile(names=("a",), t_dw=(1.0,), t_dy=(0.0,), t_fw=1.0, t_full=2.0, device="cpu", fingerprint="f",
                         unused=(), method="measured", numel=(1,))  # fmt: skip
    sets, model = baselines.suffix_sets(prof, head=["a"]), StepTimeModel.from_profile(prof)
    assert sets == [(True,)]

    def timed(mask: tuple[bool, ...]) -> float:
        raise AssertionError("a full step is not timed again")

    with pytest.raises(SpeedupOutOfReach, match=r"at most 1.00 .* timed at 100% of a full step. Found: 1.5$"):
        baselines.last_k_by_measured_steps(sets, timed, 2.0, 1.5, model)
    with pytest.raises(ValueError, match=r"^`full_step` must be a number of seconds > 0. Found: 0.0$"):
        baselines.last_k_by_measured_steps(sets, timed, 0.0, 1.5, model)


def test_the_pass_alone_overspends_where_the_calibrated_model_fits_the_step() -> None:
    prof = TimingProfile(
        names=("a", "b", "c"), t_dw=(1.0, 1.0, 1.0), t_dy=(0.0, 1.0, 1.0), t_fw=1.0, t_full=6.0,
        device="cpu", fingerprint="f", unused=(), method="measured", numel=(1, 1, 1),
    )  # fmt: skip
    # The pass: full 6, at 1.5x a budget of 4 fits {b, c} (1 + 2 + 1 = 4). A measured step of 9 with an update of 1
    # leaves 2 beyond the pass that every step pays: {b, c} costs 4 + 2 + 2/3 of the update = 6.67 > 9 / 1.5 = 6.
    model = StepTimeModel.calibrated(prof, full_step=9.0, optimizer_seconds=1.0)
    assert model.full == 9.0
    assert last_k_within_budget(prof, 1.5) == ["b", "c"]
    assert model.predict([False, True, True]) > model.full / 1.5 >= model.predict([False, False, True])
    assert last_k_within_budget(prof, 1.5, model=model) == ["c"]


def test_the_offline_step_is_the_median_of_steady_steps_on_a_copy_that_leaves_everything_as_it_was() -> None:
    torch.manual_seed(0)
    module = ImageClassifier(tiny_cnn(num_classes=2), num_classes=2, lr=0.1)
    batch = (torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 0, 1]))
    before = {k: v.clone() for k, v in module.state_dict().items()}
    # Each step reads the clock 4 times: step start, update start, update stop, step stop.
    steps = [9.0, 7.0, 6.0, 5.0, 2.0, 3.0, 2.5]  # the first WARMUP_STEPS are slow and left out
    updates = [0.5, 0.4, 0.3, 0.3, 0.2, 0.25, 0.1]
    ticks, now = [], 0.0
    for full, upd in zip(steps, updates, strict=True):
        ticks += [now, now + 1.0, now + 1.0 + upd, now + full]
        now += full + 10.0
    clock = iter(ticks)
    state = torch.get_rng_state()
    assert len(steps) == warmup.WARMUP_STEPS + method.OFFLINE_STEPS
    assert method.offline_step(module, batch, clock=lambda: next(clock)) == pytest.approx((2.5, 0.2))
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())
    assert all(p.grad is None for p in module.parameters())


def test_the_offline_step_of_a_suffix_trains_it_alone_on_a_copy_and_leaves_the_module_trainable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With `trained`, the copy's optimizer holds those tensors alone, as `TrainOnly` leaves them in the fit, and
    only they change on the copy; the module keeps every tensor trainable and every value."""
    torch.manual_seed(0)
    module = ImageClassifier(tiny_cnn(num_classes=2), num_classes=2, lr=0.1)
    batch = (torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 0, 1]))
    before = {k: v.clone() for k, v in module.state_dict().items()}
    head = head_only(module, ["model.10.*"])
    seen: list[tuple[set[str], dict[str, torch.Tensor]]] = []
    build = ImageClassifier.configure_optimizers

    def recorded(self: ImageClassifier) -> torch.optim.Optimizer:
        optimizer = build(self)
        ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
        seen.append(({n for n, p in self.named_parameters() if id(p) in ids}, dict(self.named_parameters())))
        return optimizer

    monkeypatch.setattr(ImageClassifier, "configure_optimizers", recorded)
    ticks = iter(float(i) for i in range(4 * (warmup.WARMUP_STEPS + method.OFFLINE_STEPS)))
    method.offline_step(module, batch, clock=lambda: next(ticks), trained=head)
    (optimized, twin), = seen
    assert optimized == set(head) and len(head) == 2
    changed = {n for n, p in twin.items() if not torch.equal(p.detach(), before[n])}
    assert changed == set(head)
    assert all(p.requires_grad for p in module.parameters())
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())
    with pytest.raises(ValueError, match=r"`names` must be parameter names of the module. Found unknown names"):
        method.offline_step(module, batch, trained=["no.such.tensor"])


class _Batches:
    """What `first_batch` reads of a datamodule: `setup` and a training loader."""

    def __init__(self) -> None:
        self.data = TensorDataset(torch.randn(8, 3, 16, 16), torch.arange(8) % 2)

    def setup(self, stage: str) -> None:
        pass

    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        return DataLoader(self.data, batch_size=4)


def test_static_last_k_fits_the_step_it_timed_before_the_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    names = tuple(n for n, _ in ImageClassifier(tiny_cnn(num_classes=2), num_classes=2).named_parameters())
    zeros = (0.0,) * len(names)
    unit = TimingProfile(names=names, t_dw=(1.0,) * len(names), t_dy=zeros, t_fw=0.0, t_full=12.0, device="cpu",
                         fingerprint="unit", unused=(), method="measured", numel=(1,) * len(names))  # fmt: skip
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(unit.to_dict()))
    timed: list[tuple[torch.Tensor, torch.Tensor]] = []
    trained_sets: list[int] = []

    def offline_step(
        module: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], trained: list[str] | None = None
    ) -> tuple[float, float]:
        timed.append(batch)
        if trained is None:
            return 18.0, 0.0  # 6 units a step besides the 12 of the pass: the calibrated model says 6 + j for j tensors
        assert set(trained) <= set(names) and {"model.10.weight", "model.10.bias"} <= set(trained)
        trained_sets.append(len(trained))
        return 4.0 + len(trained), 0.0  # a partial step is cheaper than that: at 2x (9 units) 5 tensors fit, not 3

    monkeypatch.setattr(method, "offline_step", offline_step)
    module = ImageClassifier(tiny_cnn(num_classes=2), num_classes=2)
    static = StaticLastK("model.10.*", 2.0, "measured", "cpu", profile=str(path))
    assert static.prepare(module, datamodule=None).trained_tensors == 6  # no data: the pass alone, 6 of 12 units
    assert not timed
    setup = static.prepare(module, datamodule=_Batches())
    assert setup.trained_tensors == 5
    assert 5 in trained_sets and 6 in trained_sets  # the choice is bracketed by timed steps: 5 within, 6 over
    assert all(batch[0].shape == (4, 3, 16, 16) for batch in timed)
    calls = len(timed)
    # the elastic callback's `calibrate=False` followed: the pass alone, with data too, and no step timed
    uncalibrated = StaticLastK("model.10.*", 2.0, "measured", "cpu", profile=str(path), calibrate=False)
    assert uncalibrated.prepare(module, datamodule=_Batches()).trained_tensors == 6 and len(timed) == calls
    with pytest.raises(ValueError, match=r"needs the training data \(a datamodule\) or a saved profile .* Found: neither"):
        StaticLastK("model.10.*", 2.0, "measured", "cpu").prepare(module, datamodule=None)


def test_last_k_pins_a_head_tied_to_the_embedding_by_its_head_name() -> None:
    """A head tied to the embedding is the embedding's tensor, which the profile names first: "out.*" pins it by its
    alias, as the callback's `train_always` does; without the alias the pattern finds the head's bias alone."""
    prof = TimingProfile(
        names=("emb.weight", "h.weight", "out.bias"), t_dw=(1.0, 1.0, 1.0), t_dy=(0.0, 1.0, 1.0), t_fw=1.0,
        t_full=6.0, device="cpu", fingerprint="f", unused=(), method="measured", numel=(1, 1, 1),
    )  # fmt: skip
    tied = {"emb.weight": ("out.weight",)}
    # the embedding pinned: 1 + 2 + 2 = 5 of 6, the whole model 6 (over 6 / 1.01)
    assert last_k_within_budget(prof, 1.01, ["out.*"], aliases=tied) == ["emb.weight", "out.bias"]
    assert last_k_within_budget(prof, 2.0, ["out.*"]) == ["out.bias"]
    with pytest.raises(ValueError, match=r"`speedup` must be at most 1.20"):
        last_k_within_budget(prof, 2.0, ["out.*"], aliases=tied)


def test_last_k_keeps_a_head_that_is_not_at_the_end() -> None:
    prof = TimingProfile(
        names=("a", "b", "c"), t_dw=(1.0, 1.0, 1.0), t_dy=(0.0, 1.0, 1.0), t_fw=1.0, t_full=6.0,
        device="cpu", fingerprint="f", unused=(), method="measured", numel=(1, 1, 1),
    )  # fmt: skip
    # full = t_fw 1 + t_dw 3 + t_dy 2 = 6, budget 6 / 2 = 3: {c} costs 1 + 1 = 2, {b, c} 1 + 2 + 1 = 4.
    assert last_k_within_budget(prof, 2.0) == ["c"]
    # Pinning `a` costs 1 + 1 + 2 = 4 on its own: two thirds of a full step, over the budget.
    with pytest.raises(ValueError, match=r"`speedup` must be at most 1.50 .* takes 67% of a full step. Found: 2"):
        last_k_within_budget(prof, 2.0, ["a"])
    assert last_k_within_budget(prof, 1.5, ["a"]) == ["a"]
    with pytest.raises(ValueError, match=r"`speedup` must be a finite number > 1. Found: 1"):
        last_k_within_budget(prof, 1)


def test_the_largest_static_speedup_is_rounded_down_and_an_infinite_one_refused() -> None:
    prof = TimingProfile(
        names=("a", "b", "c"), t_dw=(1.0, 1.0, 1.0), t_dy=(0.0, 1.0, 1.0), t_fw=70.0, t_full=75.0,
        device="cpu", fingerprint="f", unused=(), method="measured", numel=(1, 1, 1),
    )  # fmt: skip
    # full 75, the cheapest step ({c}) 71: at most 75 / 71 = 1.0563..., which `:.2f` would show as 1.06
    refusal = r"`speedup` must be at most 1.05 for a static selection .* Found: 1.06"
    with pytest.raises(SpeedupOutOfReach, match=refusal) as refused:
        last_k_within_budget(prof, 1.06)
    assert refused.value.reachable == 1.05  # the benchmark reports it as a refusal before training, with this figure
    assert last_k_within_budget(prof, 1.05) == ["c"]
    with pytest.raises(ValueError, match=r"^`speedup` must be a finite number > 1. Found: inf$"):
        last_k_within_budget(prof, math.inf)
    with pytest.raises(ValueError, match=r"^`static_speedup` must be a finite number > 1. Found: inf$"):
        StaticLastK("*", math.inf, "measured", "cpu")


def test_train_only_sets_requires_grad_and_drops_frozen_gradients() -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    net(torch.randn(3, 2)).sum().backward()
    assert train_only(net, ["1.weight", "1.bias"]) == 2
    assert [p.requires_grad for p in net.parameters()] == [False, False, True, True]
    assert net[0].weight.grad is None and net[1].weight.grad is not None
    with pytest.raises(
        ValueError, match=r"`names` must be parameter names of the module. Found unknown names: \['2.bias'\]"
    ):
        train_only(net, ["2.bias"])


def _images(samples: int = 32) -> DataLoader[tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(samples, 3, 8, 8, generator=generator)
    return DataLoader(TensorDataset(images, torch.arange(samples) % 2), batch_size=8)


def test_train_only_callback_updates_only_the_named_tensors_and_gives_the_optimizer_only_those() -> None:
    module = ImageClassifier(tiny_cnn(num_classes=2), num_classes=2, lr=0.05)
    names = head_only(module, ["model.10.*"])
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    trainer = tiny_trainer(max_epochs=1, callbacks=[TrainOnly(names)])
    trainer.fit(module, _images())
    changed = {n for n, p in module.named_parameters() if not torch.equal(p, before[n])}
    assert changed == set(names)
    optimized = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
    assert optimized == {id(p) for n, p in module.named_parameters() if n in names}
    with pytest.raises(ValueError, match=r"`names` must name at least one parameter to train. Found: none"):
        TrainOnly([])


def test_attached_backbone_is_every_parameter_but_the_head_and_changes_no_name() -> None:
    module = ImageClassifier(efficientnet_lite0(num_classes=3, pretrained=False), num_classes=3)
    keys = list(module.state_dict())
    backbone = attach_backbone(module, ["model._fc.*"])
    in_backbone = {id(p) for p in backbone.parameters()}
    expected = {id(p) for n, p in module.named_parameters() if not n.startswith("model._fc.")}
    assert in_backbone == expected
    assert list(module.state_dict()) == keys and module.backbone is backbone


def test_backbone_finetuning_trains_the_head_then_everything() -> None:
    module = ImageClassifier(tiny_cnn(num_classes=2), num_classes=2, lr=0.05)
    attach_backbone(module, ["model.10.*"])
    changed_per_epoch = []
    snapshot = {n: p.detach().clone() for n, p in module.named_parameters()}

    class Watch(BackboneFinetuning):
        def on_train_epoch_end(self, trainer: object, pl_module: nn.Module) -> None:  # type: ignore[override]
            changed_per_epoch.append({n for n, p in pl_module.named_parameters() if not torch.equal(p, snapshot[n])})
            snapshot.update({n: p.detach().clone() for n, p in pl_module.named_parameters()})

    tiny_trainer(max_epochs=2, callbacks=[Watch(unfreeze_backbone_at_epoch=1)]).fit(module, _images())
    convs = {f"model.{i}.{k}" for i, k in itertools.product((0, 3, 6), ("weight", "bias"))}
    # Epoch 0: the head and the BatchNorm layers (Lightning's train_bn=True); epoch 1: every tensor.
    assert changed_per_epoch[0] == {n for n, _ in module.named_parameters()} - convs
    assert changed_per_epoch[1] == {n for n, _ in module.named_parameters()}


def test_freeze_fraction_is_composers_linear_schedule() -> None:
    assert [freeze_fraction(p) for p in (0.0, 0.25, 0.5, 0.6, 0.75, 1.0)] == pytest.approx([0, 0, 0, 0.2, 0.5, 1])
    assert freeze_fraction(0.5, freeze_start=0.0, freeze_level=0.5) == 0.25
    assert freeze_fraction(0.2, freeze_start=0.0) == pytest.approx(0.2)


def test_layers_are_the_modules_with_parameters_from_the_input_side_without_the_head() -> None:
    module = ImageClassifier(tiny_cnn(num_classes=2), num_classes=2)
    layers = layers_from_input(module, ["model.10.*"])
    assert layers == [[f"model.{i}.weight", f"model.{i}.bias"] for i in (0, 1, 3, 4, 6)]


def test_linear_freeze_freezes_layers_from_the_input_side_at_the_steps_the_schedule_says() -> None:
    module = ImageClassifier(tiny_cnn(num_classes=2), num_classes=2, lr=0.05)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    trainable: list[list[str]] = []
    frozen_at: dict[str, torch.Tensor] = {}

    class Watch(LinearFreeze):  # records, after the freezing of each step, which tensors train in it
        def on_train_batch_start(self, trainer: object, pl_module: nn.Module, batch: object, batch_idx: int) -> None:  # type: ignore[override]
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)  # type: ignore[arg-type]
            trainable.append([n.removeprefix("model.") for n, p in pl_module.named_parameters() if p.requires_grad])
            for n, p in pl_module.named_parameters():
                if not p.requires_grad and n not in frozen_at:
                    frozen_at[n] = p.detach().clone()

    # 10 steps, 5 layers below the head: frozen from step 6 (progress 0.6: 0.2 x 5 = 1 layer) one more per step
    tiny_trainer(max_epochs=1, callbacks=[Watch(["model.10.*"])]).fit(module, _images(80))
    layers = [[f"{i}.weight", f"{i}.bias"] for i in (0, 1, 3, 4, 6)]
    head = ["10.weight", "10.bias"]
    everything = [n for layer in layers for n in layer] + head
    assert len(trainable) == 10
    assert trainable[:6] == [everything] * 6
    for step, depth in zip((6, 7, 8, 9), (1, 2, 3, 4), strict=True):
        assert trainable[step] == [n for layer in layers[depth:] for n in layer] + head
    # a frozen tensor is never updated again
    params = dict(module.named_parameters())
    assert set(frozen_at) == {f"model.{n}" for layer in layers[:4] for n in layer}
    assert all(torch.equal(params[n], value) for n, value in frozen_at.items())
    assert not torch.equal(params["model.6.weight"], before["model.6.weight"])  # trained in every step


def test_linear_freeze_settings_are_checked_together() -> None:
    with pytest.raises(ValueError) as error:
        LinearFreeze(["head.*"], freeze_start=1.0, freeze_level=True)
    assert str(error.value) == (
        "`freeze_start` must be a number in [0, 1). Found: 1.0; `freeze_level` must be a number in [0, 1]. Found: True"
    )
