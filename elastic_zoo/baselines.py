"""The usual fine-tuning baselines that elastic tensor selection is compared with: which tensors each one trains.

Each policy is a pure function from the module (and, for the static selection, a timing profile) to the names of
the parameters to train; `TrainOnly` is the thin callback that applies such a set before the optimizer is built,
so the optimizer holds only the trained tensors, as a user of the baseline would write it.

- head only: the new classifier, everything else frozen;
- BitFit-like: the head, every bias and every normalisation layer's scale and shift;
- static last k: the head and the last k tensors (nearest the output), k the largest whose training step fits
  `1 / speedup` of a full step, chosen once: by the step timed before the fit (`last_k_by_measured_steps`, the time
  model only guiding the search), or by the time model alone (`last_k_within_budget`);
- Lightning's `BackboneFinetuning` needs a `backbone` attribute: `attach_backbone` gives the module one;
- composer-style linear layer freezing (`LinearFreeze`): layers frozen from the input side, none until
  `freeze_start` of training, then linearly more until `freeze_level` of them at the end; the head never.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from torch import nn
from typing_extensions import override

from lightning_elastic.arguments import speedup_problem
from lightning_elastic.errors import SpeedupOutOfReach
from lightning_elastic.freezing import match_patterns, tied_names
from lightning_elastic.profiling import TimingProfile
from lightning_elastic.reach import at_most
from lightning_elastic.time_model import StepTimeModel

# Layers whose parameters are a scale and a shift of normalised activations: BitFit trains them with the biases.
_NORM_LAYERS: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._BatchNorm,
    nn.GroupNorm,
    nn.LayerNorm,
    nn.modules.instancenorm._InstanceNorm,
)


def head_only(module: nn.Module, head: Sequence[str]) -> list[str]:
    """Names of the parameters matching the shell-style `head` patterns: the classifier, trained alone.

    Example:
        >>> head_only(nn.Sequential(nn.Conv2d(3, 4, 3), nn.Linear(4, 2)), ["1.*"])
        ['1.weight', '1.bias']
    """
    names = [name for name, _ in module.named_parameters()]
    keep = match_patterns(names, head, "head", tied_names(module))  # a head tied to the embedding by either name
    return [n for n, kept in zip(names, keep, strict=True) if kept]


def bitfit(module: nn.Module, head: Sequence[str]) -> list[str]:
    """Names of the head's parameters, every bias, and the scale and shift of every normalisation layer.

    Example:
        >>> net = nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4), nn.Conv2d(4, 4, 1), nn.Linear(4, 2))
        >>> bitfit(net, ["3.*"])
        ['1.weight', '1.bias', '2.bias', '3.weight', '3.bias']
    """
    norm = {
        f"{prefix}.{name}" if prefix else name
        for prefix, layer in module.named_modules()
        if isinstance(layer, _NORM_LAYERS)
        for name, _ in layer.named_parameters(recurse=False)
    }
    heads = set(head_only(module, head))
    return [
        name
        for name, _ in module.named_parameters()
        if name in heads or name in norm or name.rsplit(".", 1)[-1] == "bias"
    ]


def last_k_within_budget(
    profile: TimingProfile,
    speedup: float,
    head: Sequence[str] = (),
    model: StepTimeModel | None = None,
    aliases: Mapping[str, Sequence[str]] | None = None,
) -> list[str]:
    """The head and the largest suffix of tensors (forward order) whose predicted step fits `1 / speedup` of full.

    `head` patterns match a tensor by its name or by any of its `aliases` (`freezing.tied_names`: a head tied to the
    embedding is the embedding's tensor, named first in the profile).

    The prediction is `model`, by default `StepTimeModel.from_profile(profile)`: the profiled pass alone, which
    leaves out what every real step pays besides (the optimizer update, the loop), so the fit runs slower than
    `speedup` (Fashion-MNIST at 3: 2.09-2.77x, docs/results.md); calibrated to a timed full step
    (`StepTimeModel.calibrated`) it prices a partial step of Lite0 high, and the fit runs faster ("1.5x" at
    1.56-2.32x). So `StaticLastK` chooses with this only without data or with `calibrate` False; with data, by timed
    steps (`last_k_by_measured_steps`). A step training more of the suffix never costs less, so the search stops at
    the first suffix over the budget.

    Raises:
        ValueError: when `speedup` is not a finite number > 1; `SpeedupOutOfReach` (a ValueError) when the head
            alone does not fit the budget (the message and `reachable` give the largest speedup that fits, rounded
            down), so that the benchmark reports it as a refusal before training, as it does the callback's.

    Example:
        >>> p = TimingProfile(names=("a", "b", "c"), t_dw=(1.0, 1.0, 1.0), t_dy=(0.0, 1.0, 1.0), t_fw=2.0,
        ...     t_full=7.0, device="cpu", fingerprint="f", unused=(), method="measured", numel=(1, 1, 1))
        >>> last_k_within_budget(p, speedup=1.1, head=["c"]), last_k_within_budget(p, speedup=1.5, head=["c"])
        (['b', 'c'], ['c'])
    """
    if (problem := speedup_problem(speedup)) is not None:
        raise ValueError(problem)
    model = StepTimeModel.from_profile(profile) if model is None else model
    sets = suffix_sets(profile, head, aliases)
    best = _largest_within(sets, model, model.full / speedup)
    if best < 0:
        raise _head_alone_refusal(model.predict(sets[0]), model.full, "takes", speedup)
    return names_of(profile, sets[best])


def names_of(profile: TimingProfile, mask: Sequence[bool]) -> list[str]:
    """The names of `profile`'s tensors that `mask` keeps."""
    return [name for name, keep in zip(profile.names, mask, strict=True) if keep]


def _head_alone_refusal(head: float, full: float, verb: str, speedup: float) -> SpeedupOutOfReach:
    """The refusal of a static `speedup` whose head alone (or last tensor) `verb` `head` seconds of a `full` step."""
    reachable = at_most(full / head)
    return SpeedupOutOfReach(
        f"`speedup` must be at most {reachable} for a static selection of this model: the head (or the last tensor) "
        f"alone {verb} {head / full:.0%} of a full step. Found: {speedup:g}",
        reachable=float(reachable),
    )


def suffix_sets(
    profile: TimingProfile, head: Sequence[str] = (), aliases: Mapping[str, Sequence[str]] | None = None
) -> list[tuple[bool, ...]]:
    """Static last-k's candidates, as masks over `profile.names`: the head with each suffix of tensors, from the head
    alone (the last tensor when there is no head) to every tensor, each training more than the one before.

    Example:
        >>> p = TimingProfile(names=("a", "b", "c"), t_dw=(1.0,) * 3, t_dy=(0.0,) * 3, t_fw=0.0, t_full=3.0,
        ...     device="cpu", fingerprint="f", unused=(), method="measured", numel=(1, 1, 1))
        >>> suffix_sets(p, head=["c"]), len(suffix_sets(p))
        ([(False, False, True), (False, True, True), (True, True, True)], 3)
    """
    required = match_patterns(profile.names, head, "head", aliases)
    n = len(profile.names)
    sets: list[tuple[bool, ...]] = []
    for k in range(n + 1):
        mask = tuple(required[i] or i >= n - k for i in range(n))
        if any(mask) and (not sets or mask != sets[-1]):
            sets.append(mask)
    return sets


# How many of `last_k_by_measured_steps`'s timings the time model guides; after them it bisects until the bracket
# closes. A guided probe that does not halve the bracket is followed by one that does.
GUIDED_PROBES = 8


def last_k_by_measured_steps(
    sets: Sequence[tuple[bool, ...]],
    measure: Callable[[tuple[bool, ...]], float],
    full_step: float,
    speedup: float,
    model: StepTimeModel,
    guided: int = GUIDED_PROBES,
) -> int:
    """The index in `sets` (`suffix_sets`, each training more) of the largest whose step, timed by `measure`, fits
    `full_step / speedup`: what makes a static fit run at the asked speedup where the time model, which prices a
    partial step from the profile, is off (chosen by the calibrated model, "1.5x" static fits of Lite0 ran at
    1.56-2.32x, docs/results.md). Each candidate is timed once, as `measure` times it: with timings that do not grow
    with the candidate (noise), the answer is a candidate timed within the budget whose next one was timed over it.

    The search keeps a bracket: the largest candidate timed within the budget and the smallest timed over it (at
    first, none and every tensor, a full step). Each of the first `guided` probes is the candidate `model` predicts
    at the budget, its prediction scaled by what the last probe timed against it, clamped inside the bracket; after
    a probe that did not halve the bracket, the next one bisects it. Then it bisects until the bracket closes: at
    most `guided` + log2(len(sets)) timings, no candidate timed twice.

    Raises:
        ValueError: when `full_step` is not > 0.
        SpeedupOutOfReach: when the first candidate (the head alone) is timed over the budget, with the largest
            speedup it fits, rounded down.

    Example:
        >>> p = TimingProfile(names=("a", "b", "c"), t_dw=(1.0,) * 3, t_dy=(0.0,) * 3, t_fw=0.0, t_full=3.0,
        ...     device="cpu", fingerprint="f", unused=(), method="measured", numel=(1, 1, 1))
        >>> timed = lambda mask: 0.8 + 0.4 * sum(mask)  # a full step of 2.0; a partial one dearer than the model says
        >>> model = StepTimeModel.from_profile(p)
        >>> last_k_by_measured_steps(suffix_sets(p), timed, 2.0, 1.5, model), len(last_k_within_budget(p, 1.5))
        (0, 2)
    """
    if not full_step > 0:
        raise ValueError(f"`full_step` must be a number of seconds > 0. Found: {full_step!r}")
    budget, fallback = full_step / speedup, full_step / model.full if model.full > 0 else 1.0
    timed: dict[int, float] = {}
    low, high = -1, len(sets) - 1  # the last candidate trains every tensor: a full step, over any budget
    guess, halve, probes = _largest_within(sets, model, budget / fallback), False, 0
    while high - low > 1:
        width = high - low
        bisect = halve or probes >= guided
        index = (low + high) // 2 if bisect else min(max(guess, low + 1), high - 1)
        timed[index], probes = measure(sets[index]), probes + 1
        low, high = (index, high) if timed[index] <= budget else (low, index)
        predicted = model.predict(sets[index])
        scale = timed[index] / predicted if predicted > 0 and timed[index] > 0 else fallback
        guess, halve = _largest_within(sets, model, budget / scale), high - low > width / 2
    if low < 0:  # the first candidate was timed over the budget, or is the only one: every tensor, a full step
        raise _head_alone_refusal(timed.get(0, full_step), full_step, "was timed at", speedup)
    return low


def _largest_within(sets: Sequence[tuple[bool, ...]], model: StepTimeModel, limit: float) -> int:
    """The index of the last of `sets` whose step `model` predicts within `limit`, -1 when none is: a set training
    more never costs less, so the scan stops at the first over."""
    best = -1
    for index, mask in enumerate(sets):
        if model.predict(mask) > limit:
            break
        best = index
    return best


def train_only(module: nn.Module, names: Iterable[str]) -> int:
    """Let only the parameters named in `names` require grad; returns how many do.

    Raises:
        ValueError: when a name is not a parameter of `module`.

    Example:
        >>> net = nn.Linear(2, 2)
        >>> train_only(net, ["bias"]), net.weight.requires_grad
        (1, False)
    """
    wanted = set(names)
    params = dict(module.named_parameters())
    unknown = sorted(wanted - set(params))
    if unknown:
        raise ValueError(f"`names` must be parameter names of the module. Found unknown names: {unknown[:5]}")
    for name, param in params.items():
        param.requires_grad_(name in wanted)
        if name not in wanted:
            param.grad = None
    return len(wanted)


class TrainOnly(Callback):
    """Freezes every parameter not named in `names` as fitting starts, before the optimizer is built.

    The zoo's `ImageClassifier` (like most fine-tuning code) hands the optimizer only the parameters that
    require grad, so the frozen ones cost nothing in the optimizer either.

    Args:
        names: parameter names (as `LightningModule.named_parameters()` gives them) to train.

    Example:
        >>> from elastic_zoo.models import tiny_cnn
        >>> from elastic_zoo.module import ImageClassifier
        >>> module = ImageClassifier(tiny_cnn(num_classes=2), num_classes=2)
        >>> trainer = L.Trainer(callbacks=[TrainOnly(head_only(module, ["model.10.*"]))], max_epochs=1)
    """

    def __init__(self, names: Iterable[str]) -> None:
        self.names = tuple(names)
        if not self.names:
            raise ValueError("`names` must name at least one parameter to train. Found: none")

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            train_only(pl_module, self.names)


def attach_backbone(module: nn.Module, head: Sequence[str]) -> nn.ModuleList:
    """Give `module` the `backbone` attribute that Lightning's `BackboneFinetuning` freezes and later unfreezes.

    The backbone is the largest submodules holding parameters but none of the head's. It is set as a plain
    attribute, not registered as a submodule, so the module's parameter names and state dict do not change.

    Example:
        >>> net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Linear(4, 2))
        >>> [type(m).__name__ for m in attach_backbone(net, ["2.*"])], net.backbone is not None
        (['Conv2d'], True)
    """
    names = set(head_only(module, head))
    heads = {id(p) for name, p in module.named_parameters() if name in names}

    def parts(node: nn.Module) -> list[nn.Module]:
        params = list(node.parameters())
        if not params:
            return []
        if not any(id(p) in heads for p in params):
            return [node]
        return [part for child in node.children() for part in parts(child)]

    backbone = nn.ModuleList(parts(module))
    object.__setattr__(module, "backbone", backbone)
    return backbone


def freeze_fraction(progress: float, freeze_start: float = 0.5, freeze_level: float = 1.0) -> float:
    """The share of layers frozen once `progress` (0 to 1) of training is done: composer's linear schedule.

    Nothing is frozen up to `freeze_start`; from there the share grows linearly to `freeze_level` at the end.

    Example:
        >>> [freeze_fraction(p) for p in (0.0, 0.5, 0.75, 1.0)]
        [0.0, 0.0, 0.5, 1.0]
    """
    if progress <= freeze_start:
        return 0.0
    return freeze_level * (min(progress, 1.0) - freeze_start) / (1.0 - freeze_start)


def layers_from_input(module: nn.Module, head: Sequence[str]) -> list[list[str]]:
    """The parameter names of every module that holds parameters of its own, in module order, the head's left out.

    Module order (registration order, depth first) is the input-to-output order of the zoo's models, as in
    composer's layer freezing; a module holding any of the head's parameters is never a layer to freeze.

    Example:
        >>> layers_from_input(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Linear(4, 2)), ["2.*"])
        [['0.weight', '0.bias'], ['1.weight', '1.bias']]
    """
    heads = set(head_only(module, head))
    layers = []
    for prefix, layer in module.named_modules():
        names = [f"{prefix}.{name}" if prefix else name for name, _ in layer.named_parameters(recurse=False)]
        if names and not heads.intersection(names):
            layers.append(names)
    return layers


class LinearFreeze(Callback):
    """Composer's layer freezing as a Lightning callback: layers frozen progressively from the input side.

    Before every training step, the first `floor(freeze_fraction(progress) x layers)` layers of
    `layers_from_input` stop requiring grad (and lose their gradient, so the optimizer skips them); a frozen
    layer stays frozen. Progress is the optimizer steps done over the fit's total. Composer applies the same
    schedule at epoch ends; here it moves at every step, so that a fit of few epochs freezes linearly too.

    Args:
        head: shell-style patterns of the head's parameter names: never frozen.
        freeze_start: share of training before freezing begins, in [0, 1) (composer's default: 0.5).
        freeze_level: share of the layers frozen at the end of training, in [0, 1] (composer's default: 1.0).

    Example:
        >>> from elastic_zoo.models import tiny_cnn
        >>> from elastic_zoo.module import ImageClassifier
        >>> module = ImageClassifier(tiny_cnn(num_classes=2), num_classes=2)
        >>> trainer = L.Trainer(callbacks=[LinearFreeze(["model.10.*"])], max_epochs=1)
    """

    def __init__(self, head: Sequence[str], freeze_start: float = 0.5, freeze_level: float = 1.0) -> None:
        problems = []
        if not _in_range(freeze_start, 0, 1, high_included=False):
            problems.append(f"`freeze_start` must be a number in [0, 1). Found: {freeze_start!r}")
        if not _in_range(freeze_level, 0, 1, high_included=True):
            problems.append(f"`freeze_level` must be a number in [0, 1]. Found: {freeze_level!r}")
        if problems:
            raise ValueError("; ".join(problems))
        self.head = tuple(head)
        self.freeze_start = float(freeze_start)
        self.freeze_level = float(freeze_level)
        self.layers: list[list[str]] = []
        self.frozen = 0

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.layers = layers_from_input(pl_module, self.head)
            self.frozen = 0

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        progress = trainer.global_step / max(1, trainer.estimated_stepping_batches)
        share = freeze_fraction(progress, self.freeze_start, self.freeze_level)
        # The guard keeps float error (0.6 - 0.5) / 0.5 * 5 = 0.999... from losing a whole layer.
        depth = min(len(self.layers), math.floor(share * len(self.layers) + 1e-9))
        if depth > self.frozen:
            params = dict(pl_module.named_parameters())
            for names in self.layers[self.frozen : depth]:
                for name in names:
                    params[name].requires_grad_(False)
                    params[name].grad = None
            self.frozen = depth


def _in_range(value: Any, low: float, high: float, high_included: bool) -> bool:
    """`value` is a number (not a bool) in [low, high] or [low, high); NaN never is."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return low <= value <= high if high_included else low <= value < high
