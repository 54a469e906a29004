"""Odd modules through a real fit that profiles them for real (`profile=None`, on the ticking clock): the profile names
every tensor that gets a gradient and nothing else, selections come on schedule, between probe windows only the
selected tensors train, and the user's `requires_grad` flags come back when the fit ends."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_elastic import ElasticTensorSelection
from lightning_elastic.errors import ElasticConfigError
from tests.adversarial.test_odd_runs import Groups, Masks, Recurrent, Tied, Unused, Values
from tests.integration.tiny import TinyNet, tiny_data, tiny_trainer

# 128 samples in batches of 32: 4 optimizer steps an epoch, 12 in 3 epochs. One-step probe windows at steps 0, 3 and
# 7 (the last step of the epoch before each later selection); selections as epochs 0 (after its window), 1 and 2 run.
STEPS = 12
WINDOWS = [0, 3, 7]
SELECTIONS = [(1, 0), (4, 1), (8, 2)]
USER_FROZEN = "net.0.bias"  # frozen by the user before the fit: never profiled, never trained, still frozen after


def data() -> Any:
    return tiny_data(samples=128, batch_size=32)


def profiling(**kwargs: Any) -> ElasticTensorSelection:
    """The callback profiling for real with the measured time model (hooks on every backward node), no cache.

    The ticking clock times every plain step at 1 ms forward and 1 ms backward whatever trains, so the profile's
    per-step speedup tops out near 1.2x: 1.1 is within reach, and still leaves most tensors out of each selection."""
    settings: dict[str, Any] = dict(
        speedup=1.1,
        interval=1,
        interval_unit="epoch",
        probe_steps=1,
        time_model="measured",
        calibrate=False,
        cache_dir=False,
        log_images=False,
    )
    settings.update(kwargs)
    return ElasticTensorSelection(**settings)


class Grads(Callback):
    """Per optimizer step: the tensors that have a gradient as the optimizer is about to apply it, by name."""

    def __init__(self) -> None:
        self.by_step: dict[int, set[str]] = {}

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.by_step[trainer.global_step] = {n for n, p in pl_module.named_parameters() if p.grad is not None}


class Checkpointed(TinyNet):
    """The hidden layers run under gradient checkpointing: backward recomputes their forward."""

    reentrant = False

    def forward(self, x: Tensor) -> Tensor:
        hidden = checkpoint(self.net[3:7], self.net[:3](x), use_reentrant=self.reentrant)
        return self.net[7](hidden)


class ReentrantCheckpointed(Checkpointed):
    """The same with the reentrant implementation (torch's `use_reentrant=True`, which older code and model libraries'
    `gradient_checkpointing_enable` still use): the segment's ops and parameters enter the autograd graph only
    inside the backward pass, which recomputes them. Its tensors get gradients whenever its input needs one."""

    reentrant = True


class Stateful(TinyNet):
    """An LSTM whose hidden state carries from step to step in an attribute; `forwards` counts forward passes."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(16, 16, batch_first=True)
        self.state: tuple[Tensor, Tensor] | None = None
        self.forwards = 0

    def forward(self, x: Tensor) -> Tensor:
        sequence, (h, c) = self.lstm(x.unsqueeze(1), self.state)
        self.state = (h.detach(), c.detach())
        self.forwards += 1
        return self.net(sequence.squeeze(1) + x)


class Embedded(TinyNet):
    """An embedding of a category read off the input, added to it: used in every forward pass."""

    def __init__(self, sparse: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(4, 16, sparse=sparse)

    def forward(self, x: Tensor) -> Tensor:
        category = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
        return self.net(x + self.embed(category))


class States(Callback):
    """The hidden state object as each step starts and as it ends (`Stateful`)."""

    def __init__(self) -> None:
        self.at_start: list[Any] = []
        self.at_end: list[Any] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.at_start.append(pl_module.state)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.at_end.append(pl_module.state)


def net_names(frozen: str = USER_FROZEN) -> list[str]:
    """TinyNet's tensors in forward order, less the user's frozen one."""
    names = [f"net.{layer}.{kind}" for layer in (0, 1, 3, 5, 7) for kind in ("weight", "bias")]
    return [name for name in names if name != frozen]


def rnn_names(module: str) -> list[str]:
    """A one-layer GRU's or LSTM's tensors."""
    return [f"{module}.{kind}_{gate}_l0" for kind in ("weight", "bias") for gate in ("ih", "hh")]


ATTENTION = ["in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"]


def by_module(names: Sequence[str]) -> list[tuple[str, set[str]]]:
    """Tensor names as the modules that own them come in `names`: the order within one module is the fused op's
    (a GRU's or an LSTM's weights and biases), which torch chooses."""
    groups: list[tuple[str, set[str]]] = []
    for name in names:
        owner = name.rsplit(".", 1)[0]
        if groups and groups[-1][0] == owner:
            groups[-1][1].add(name)
        else:
            groups.append((owner, {name}))
    return groups


# What the profile must name (in forward order), and leave out as unused: the tensors that get a gradient, and those
# that never do. Each module is profiled by hooks on every backward node ("measured"), those with ops of their own by
# op counts ("flops") too.
PROFILED: dict[type[TinyNet], tuple[list[str], list[str]]] = {
    Tied: ([n for n in net_names() if n != "net.5.weight"], []),  # net.5.weight is net.3.weight: named once
    Unused: (net_names(), ["spare.weight", "spare.bias"]),
    Groups: (net_names(), []),
    Recurrent: ([*rnn_names("rnn"), *[f"attention.{n}" for n in ATTENTION], *net_names()], []),
    Checkpointed: (net_names(), []),
    Stateful: ([*rnn_names("lstm"), *net_names()], []),
    Embedded: (["embed.weight", *net_names()], []),
}


PLAIN_OPS = (Tied, Unused, Groups)  # their ops are TinyNet's: counting them ("flops") shows nothing new
CASES = [(t, m) for t in PROFILED for m in ("measured", "flops") if m == "measured" or t not in PLAIN_OPS]


@pytest.mark.parametrize(("module_type", "time_model"), CASES, ids=[f"{t.__name__}-{m}" for t, m in CASES])
@pytest.mark.usefixtures("ticking_profiler")
def test_odd_modules_profiled_for_real_train_only_their_selection_and_get_their_flags_back(
    module_type: type[TinyNet], time_model: str
) -> None:
    torch.manual_seed(0)
    module = module_type()
    module.get_parameter(USER_FROZEN).requires_grad_(False)
    user_flags = [p.requires_grad for p in module.parameters()]
    callback, values, masks, grads, states = profiling(time_model=time_model), Values(), Masks(), Grads(), States()
    extra = [states] if module_type is Stateful else []
    trainer = tiny_trainer(callbacks=[callback, values, masks, grads, *extra], max_epochs=3)
    trainer.fit(module, data())

    assert trainer.global_step == STEPS
    assert [(r.step, r.epoch) for r in callback.history] == SELECTIONS
    prof = callback.timing_profile
    assert prof is not None and prof.method == time_model
    profiled, unused = PROFILED[module_type]
    names = [n for n, _ in module.named_parameters()]
    trainable = {s: {n for n, t in zip(names, masks.by_step[s], strict=True) if t} for s in range(STEPS)}
    every = set(profiled) | set(unused)  # what a probe window trains: every tensor the user left trainable
    assert [s for s in range(STEPS) if trainable[s] == every] == WINDOWS
    for (step, _), record, end in zip(SELECTIONS, callback.history, [3, 7, STEPS], strict=True):
        selected = {n for n, f in zip(prof.names, record.mask, strict=True) if f}
        assert selected and selected != set(prof.names), record.mask  # a real selection: some, not all
        for s in range(step, end):  # until the next window, only the selection changes, and exactly it may train
            assert values.changed[s] <= selected, (s, values.changed[s] - selected)
            assert trainable[s] == selected | set(unused), (s, trainable[s] - selected - set(unused))

    assert by_module(prof.names) == by_module(profiled) and list(prof.unused) == unused
    for s in range(STEPS):
        assert grads.by_step[s] == trainable[s] & set(profiled), s  # every profiled tensor trained gets a gradient
        # and changes, but a first hidden-to-hidden weight: the first step's hidden state is zeros
        unchanged = {"lstm.weight_hh_l0"} if module_type is Stateful and s == 0 else set()
        assert values.changed[s] == grads.by_step[s] - unchanged, s
    assert USER_FROZEN not in set().union(*trainable.values())
    assert [p.requires_grad for p in module.parameters()] == user_flags
    if module_type is Stateful:  # profiling ran no forward pass that the module kept: the state chains step to step
        assert module.forwards == STEPS
        assert states.at_start[0] is None
        assert all(states.at_start[s] is states.at_end[s - 1] for s in range(1, STEPS))
        assert len({id(state) for state in states.at_end}) == STEPS


@pytest.mark.parametrize("time_model", ["measured", "flops"])
@pytest.mark.usefixtures("ticking_profiler")
def test_reentrant_checkpointing_is_refused_before_any_update_naming_the_tensors_it_hides(time_model: str) -> None:
    # The graph walked from the loss shows only the checkpoint's node: net.3 and net.5 would train outside the profile.
    torch.manual_seed(0)
    module = ReentrantCheckpointed()
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    trainer = tiny_trainer(callbacks=[profiling(time_model=time_model)], max_epochs=3)
    hidden = r"\['net\.3\.weight', 'net\.3\.bias', 'net\.5\.weight', 'net\.5\.bias'\]$"
    with pytest.raises(ElasticConfigError, match=r"use `use_reentrant=False`; .* Found only during backward: " + hidden):
        trainer.fit(module, data())
    assert trainer.global_step == 0 and all(torch.equal(p, before[n]) for n, p in module.named_parameters())
    assert all(p.requires_grad for p in module.parameters())


class AuxInBackward(TinyNet):
    """A regulariser that `training_step` keeps apart (for logging, say) and an overridden `backward` adds: its
    tensors get gradients in every step, outside the graph of the loss `training_step` returns."""

    def __init__(self) -> None:
        super().__init__()
        self.aux = nn.Linear(16, 1)
        self.aux_loss: Tensor | None = None

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        self.aux_loss = self.aux(batch[0]).pow(2).mean()
        return super().training_step(batch, batch_idx)

    def backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        assert self.aux_loss is not None
        (loss + 0.01 * self.aux_loss).backward(*args, **kwargs)


@pytest.mark.usefixtures("ticking_profiler")
def test_a_loss_added_outside_the_returned_one_is_refused_before_any_update_with_both_ways_out() -> None:
    """The fit's first step (Adam: it is the profile's first pass) computed gradients the returned loss's graph does
    not reach: refused before the first update, naming the tensors, with the way out of this case (return the whole
    loss) beside the reentrant checkpoint's; before, the message named the checkpoint alone."""
    torch.manual_seed(0)
    module = AuxInBackward()
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    trainer = tiny_trainer(callbacks=[profiling(time_model="flops")], max_epochs=3)
    with pytest.raises(
        ElasticConfigError,
        match=r"a loss that `training_step` does not return \(added in an overridden `backward` or a hook\): return the "
        r"whole loss\. .* Found only during backward: \['aux\.weight', 'aux\.bias'\]$",
    ):
        trainer.fit(module, data())
    assert trainer.global_step == 0 and all(torch.equal(p, before[n]) for n, p in module.named_parameters())


@pytest.mark.usefixtures("ticking_profiler")
def test_a_sparse_embedding_used_in_forward_is_refused_before_any_update_naming_the_parameter() -> None:
    torch.manual_seed(0)
    module = Embedded(sparse=True)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    trainer = tiny_trainer(callbacks=[profiling()], max_epochs=3)
    with pytest.raises(
        ElasticConfigError, match=r"needs dense gradients .* Found sparse gradients for: \['embed\.weight'\]"
    ):
        trainer.fit(module, data())
    assert trainer.global_step == 0
    assert all(torch.equal(p, before[n]) for n, p in module.named_parameters())  # refused before the first update
    assert all(p.requires_grad for p in module.parameters())

    callback, values = profiling(train_never=["embed.*"]), Values()  # the way out the message names
    tiny_trainer(callbacks=[callback, values], max_epochs=3).fit(module, data())
    assert callback.timing_profile is not None
    assert (list(callback.timing_profile.names), callback.timing_profile.unused) == (net_names(frozen=""), ())
    assert [(r.step, r.epoch) for r in callback.history] == SELECTIONS
    assert not any("embed.weight" in changed for changed in values.changed.values())
    assert all(p.requires_grad for p in module.parameters())
