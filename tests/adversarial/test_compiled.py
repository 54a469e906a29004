"""torch.compile: profiling measures the eager step and compiles nothing; a fit compiles one graph per change of the
trainable set, counted in the summary. Compiled autograd: the config flag changes nothing in a Lightning fit, and
compiled autograd enabled around the fit is refused."""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import reduce
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn

from lightning_elastic import ElasticTensorSelection
from lightning_elastic.errors import ElasticConfigError
from lightning_elastic.freezing import CACHE_ENTRIES, RESET_CODE, compiled_graphs
from tests.integration.test_callback import Recorder, elastic
from tests.integration.tiny import TinyNet, synthetic_profile, tiny_data, tiny_trainer

FORMS = ("given to fit compiled", "a compiled submodule", "a submodule compiled in place")


class Quiet(TinyNet):
    """TinyNet whose step does not log: `self.log` breaks a compiled `training_step` in two graphs and recompiles on
    Lightning's logging state, graphs of Lightning's, not of the callback's."""

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)


def compiled(form: str) -> tuple[nn.Module, Quiet]:
    """The module as the user passes it to `fit`, compiled whole or in part (backend "aot_eager": CPU, no C++), and
    the LightningModule that trains."""
    module = Quiet()
    if form == "given to fit compiled":
        return torch.compile(module, backend="aot_eager"), module  # type: ignore[return-value]
    if form == "a compiled submodule":
        module.net = torch.compile(module.net, backend="aot_eager")  # type: ignore[assignment]
    else:
        module.net.compile(backend="aot_eager")  # `Module.compile()`: the submodule keeps its type
    return module, module


class Graphs(Callback):
    """Dynamo's count of compiled graphs as the fit starts and once the profile is taken (listed after the elastic
    callback, whose `on_train_start` profiles), and the trainable set of every step."""

    def __init__(self) -> None:
        self.at_fit_start = self.after_profiling = -1
        self.sets: list[tuple[bool, ...]] = []

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.at_fit_start = compiled_graphs()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.after_profiling = compiled_graphs()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.sets.append(tuple(p.requires_grad for p in pl_module.parameters()))


def profiled(model: nn.Module, graphs: Graphs) -> ElasticTensorSelection:
    """A short fit that profiles `model` for real (no given profile, no cache) on the profiler's ticking clock (the
    `ticking_profiler` fixture): its timings follow the step's ops, so a speedup of 1.001 is in reach however busy
    the machine (its forward pass was measured at 98% of a step on a busy day)."""
    callback = ElasticTensorSelection(speedup=1.001, probe_steps=2, calibrate=False, cache_dir=False)
    tiny_trainer(callbacks=[callback, graphs], max_steps=3).fit(model, tiny_data())  # type: ignore[arg-type]
    return callback


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.usefixtures("ticking_profiler")
def test_profiling_a_compiled_module_measures_the_eager_step_and_compiles_nothing(form: str) -> None:
    """Before: profiling compiled 9-10 graphs, its hooks timed dynamo's frames and one `CompiledFunctionBackward`
    node for the compiled part, and the profile's fingerprint was not the eager step's."""
    with torch.compiler.set_stance("force_eager"):  # the reference: the same module with compiling turned off
        eager = profiled(compiled(form)[0], Graphs())
    graphs = Graphs()
    callback = profiled(compiled(form)[0], graphs)
    assert graphs.after_profiling == graphs.at_fit_start  # profiling compiled no graph
    assert callback.timing_profile is not None and eager.timing_profile is not None
    # the fingerprint covers the step's autograd graph: the eager step's, with no `CompiledFunctionBackward`
    assert callback.timing_profile.fingerprint == eager.timing_profile.fingerprint
    assert callback.timing_profile.names == eager.timing_profile.names


@pytest.mark.parametrize("form", FORMS)
def test_a_compiled_fit_compiles_one_graph_per_change_of_the_trainable_set(form: str) -> None:
    """Probe window (every tensor), selection, window, selection: three changes, four graphs, each counted."""
    model, module = compiled(form)
    callback = ElasticTensorSelection(
        speedup=1.6, interval=4, interval_unit="step", probe_steps=2, profile=synthetic_profile(module), calibrate=False
    )
    graphs = Graphs()
    tiny_trainer(callbacks=[callback, graphs], max_steps=10).fit(model, tiny_data())  # type: ignore[arg-type]
    changes = [k for k in range(1, len(graphs.sets)) if graphs.sets[k] != graphs.sets[k - 1]]
    assert len(graphs.sets) == 10 and len(changes) == 3
    assert all(graphs.sets[0]) and not all(graphs.sets[changes[0]])
    assert compiled_graphs() - graphs.at_fit_start == 4
    assert callback.summary()["compiled_graphs"] == 4


def test_compiled_module_runs_the_new_selection() -> None:
    callback = elastic()
    recorder = Recorder()
    module = TinyNet()
    compiled = torch.compile(module, backend="aot_eager")
    tiny_trainer(callbacks=[callback, recorder], max_steps=10).fit(compiled, tiny_data())  # type: ignore[arg-type]
    for trainable, changed in zip(recorder.trainable, recorder.changed, strict=True):
        assert all(t or not c for t, c in zip(trainable, changed, strict=True))
    assert any(not all(t) for t in recorder.trainable)
    changes = sum(1 for a, b in zip(recorder.trainable, recorder.trainable[1:], strict=False) if a != b)
    graphs = callback.summary()["compiled_graphs"]
    assert changes == 3 and 1 + changes <= graphs <= 3 * (1 + changes)  # counted, and bounded by the changes


@pytest.mark.parametrize("form", FORMS)
def test_the_compiled_autograd_flag_leaves_a_compiled_fit_as_it_is(form: str) -> None:
    """`torch._dynamo.config.compiled_autograd = True` compiles only backward passes run inside a compiled frame;
    Lightning runs `loss.backward()` outside one: nothing is captured, and the fit compiles the same four graphs as
    without the flag."""
    from torch._dynamo.utils import counters

    captures = counters["compiled_autograd"]["captures"]
    model, module = compiled(form)
    callback = ElasticTensorSelection(
        speedup=1.6, interval=4, interval_unit="step", probe_steps=2, profile=synthetic_profile(module), calibrate=False
    )
    graphs, recorder = Graphs(), Recorder()
    with torch._dynamo.config.patch(compiled_autograd=True):
        trainer = tiny_trainer(callbacks=[callback, graphs, recorder], max_steps=10)
        trainer.fit(model, tiny_data())  # type: ignore[arg-type]
    assert counters["compiled_autograd"]["captures"] == captures
    assert compiled_graphs() - graphs.at_fit_start == 4 and callback.summary()["compiled_graphs"] == 4
    for trainable, changed in zip(recorder.trainable, recorder.changed, strict=True):
        assert all(t or not c for t, c in zip(trainable, changed, strict=True))  # only the selection trains


def test_compiled_autograd_is_refused_before_the_fit_starts() -> None:
    """Enabled for the fit (`compiled_autograd._enable`), compiled autograd would compile the profiler's backward
    passes (their per-node times are then a capture's): refused as the fit is set up, naming the setting."""
    from torch._dynamo import compiled_autograd

    model, module = compiled(FORMS[0])
    callback = ElasticTensorSelection(speedup=1.6, profile=synthetic_profile(module), calibrate=False)
    steps = Recorder()
    refused = pytest.raises(ElasticConfigError, match=r"cannot run with compiled autograd .* Found: compiled autograd")
    with compiled_autograd._enable(torch.compile(backend="aot_eager")), refused:
        tiny_trainer(callbacks=[callback, steps], max_steps=4).fit(model, tiny_data())  # type: ignore[arg-type]
    assert steps.steps == []
    assert all(p.requires_grad for p in module.parameters())


def scale(x: Tensor) -> Tensor:
    """The user's own compiled function, outside the fit's step (a metric, a post-processing step)."""
    return x * 2 + 1


@pytest.mark.parametrize("form", ("eager", *FORMS))
def test_a_fit_leaves_the_users_other_compiled_function_compiled(form: str) -> None:
    """The selections reset what the fit's step compiled, not the process's dynamo: a function compiled before the
    fit runs after it without compiling again. Before: a compiled fit called `torch._dynamo.reset()` at each change
    of the trainable set, and the function compiled twice."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    user_function = torch.compile(scale, backend=counter)
    user_function(torch.ones(3))
    model, module = (Quiet(), None) if form == "eager" else compiled(form)
    callback = ElasticTensorSelection(
        speedup=1.6,
        interval=4,
        interval_unit="step",
        probe_steps=2,
        profile=synthetic_profile(module or model),
        calibrate=False,
    )
    graphs = Graphs()
    tiny_trainer(callbacks=[callback, graphs], max_steps=10).fit(model, tiny_data())  # type: ignore[arg-type]
    user_function(torch.ones(3))
    assert counter.frame_count == 1
    assert callback.summary()["compiled_graphs"] == (0 if form == "eager" else 4)  # the fit's own: reset each change


def test_a_compiled_fit_leaves_a_second_compiled_model_compiled() -> None:
    """A second model compiled by the user (an EMA copy, a teacher) keeps its graph through the fit of a module given
    to `fit` compiled (Lightning compiles its `training_step`: a code of its own). A compiled submodule's graphs live
    in torch's one frame that every compiled module shares: see docs/compatibility.md."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    teacher = torch.compile(nn.Linear(3, 2), backend=counter)
    teacher(torch.ones(1, 3))
    model, module = compiled(FORMS[0])
    callback = ElasticTensorSelection(
        speedup=1.6, interval=4, interval_unit="step", probe_steps=2, profile=synthetic_profile(module), calibrate=False
    )
    tiny_trainer(callbacks=[callback], max_steps=10).fit(model, tiny_data())  # type: ignore[arg-type]
    teacher(torch.ones(1, 3))
    assert counter.frame_count == 1 and callback.summary()["compiled_graphs"] == 4


def fit_resetting_all_of_dynamo(warning: str) -> None:
    """A compiled fit on a torch whose partial reset is out of use: it still compiles one graph per change of the
    trainable set and trains only the selection, by resetting all of dynamo at each selection; one warning (matching
    `warning`) says so, and the user's other compiled function pays for it (compiled again after the fit's two
    resets, once)."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    user_function = torch.compile(scale, backend=counter)
    user_function(torch.ones(3))
    model, module = compiled(FORMS[0])
    callback = ElasticTensorSelection(
        speedup=1.6, interval=4, interval_unit="step", probe_steps=2, profile=synthetic_profile(module), calibrate=False
    )
    graphs, recorder = Graphs(), Recorder()
    trainer = tiny_trainer(callbacks=[callback, graphs, recorder], max_steps=10)
    with pytest.warns(UserWarning, match=warning) as warned:
        trainer.fit(model, tiny_data())  # type: ignore[arg-type]
    assert sum("resets all of dynamo instead" in str(w.message) for w in warned) == 1
    assert compiled_graphs() - graphs.at_fit_start == 4 and callback.summary()["compiled_graphs"] == 4
    for trainable, changed in zip(recorder.trainable, recorder.changed, strict=True):
        assert all(t or not c for t, c in zip(trainable, changed, strict=True))  # only the selection trains
    user_function(torch.ones(3))
    assert counter.frame_count == 2


def test_a_torch_without_the_internals_of_a_partial_reset_resets_all_of_dynamo_with_one_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A torch that lacks `reset_code` (an internal a torch upgrade may remove). Before: the removal went unseen,
    with no warning."""
    monkeypatch.delattr(torch._C._dynamo.eval_frame, "reset_code")
    fit_resetting_all_of_dynamo(r"lacks torch\._C\._dynamo\.eval_frame\.reset_code, .* all of dynamo")


@pytest.mark.parametrize(
    ("internal", "changed"),
    [
        (RESET_CODE, lambda code, flags: None),  # the fit's first reset calls it
        (CACHE_ENTRIES, lambda: []),  # called as the fit starts, to know what was compiled before
    ],
    ids=("reset_code", "_debug_get_cache_entry_list"),
)
def test_a_torch_internal_of_another_signature_resets_all_of_dynamo_with_one_warning(
    internal: str, changed: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A torch upgrade that keeps an internal of the partial reset but changes its signature: the compiled fit
    completes on the fallback of a missing internal, and its warning names the internal and what it raised.
    Before: the fit crashed with the internal's TypeError."""
    owner, _, name = internal.rpartition(".")
    monkeypatch.setattr(reduce(getattr, owner.split(".")[1:], torch), name, changed)
    raised = r"positional argument|takes 0 positional arguments but 1 was given"
    fit_resetting_all_of_dynamo(rf"has {re.escape(internal)}, but using it raised TypeError: .*({raised}).* all of dyn")


def middle(h: Tensor, w: Tensor) -> Tensor:
    """The user's compiled function inside `training_step`: most of the step's work, on a parameter of the module."""
    return torch.relu(h @ w) @ w


class WithCompiledFunction(Quiet):
    """A module that is not compiled, whose step calls a compiled function (`is_compiled` cannot see it)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(3, 3) * 0.1)
        self.middle = torch.compile(middle, backend="aot_eager")

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self.middle(self(x), self.w), y)


class StepGraphs(Graphs):
    """Dynamo's count of compiled graphs as each optimizer step starts too."""

    def __init__(self) -> None:
        super().__init__()
        self.at_step: list[int] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.at_step.append(compiled_graphs())
        super().on_train_batch_start(trainer, pl_module, *args)


@pytest.mark.parametrize("time_model", ["flops", "measured"])
@pytest.mark.usefixtures("ticking_profiler")
def test_a_compiled_function_inside_the_step_runs_eager_in_the_first_step_that_profiling_records(
    time_model: str,
) -> None:
    """The fit's first step records the profile's signature (and, for the analytic profile, counts its ops): it runs
    eager, as the profiler's own passes do, so its graph is the eager step's and the function compiles at the next
    step, once, as a fit without the callback compiles it at its first (and again as a selection changes whether `w`
    trains, as in any compiled fit). Before: under the analytic profile's op count the first step compiled the
    function 3 times (the counting mode is part of dynamo's guards), and the signature held the compiled function's
    `CompiledFunctionBackward` node, not the eager step's nodes the profile timed."""
    torch._dynamo.reset()
    graphs = StepGraphs()

    def fitted(model: WithCompiledFunction, callbacks: list[Callback]) -> ElasticTensorSelection:
        callback = ElasticTensorSelection(
            speedup=1.001, probe_steps=2, calibrate=False, cache_dir=False, time_model=time_model
        )  # fmt: skip
        tiny_trainer(callbacks=[callback, *callbacks], max_steps=3).fit(model, tiny_data())
        return callback

    with torch.compiler.set_stance("force_eager"):  # the reference: the same step with compiling turned off
        eager = fitted(WithCompiledFunction(), [])
    callback = fitted(WithCompiledFunction(), [graphs])
    # the first step compiled nothing, the second (in the first probe window, with the same trainable set) one graph
    assert [n - graphs.at_fit_start for n in graphs.at_step[:3]] == [0, 0, 1]
    assert callback.timing_profile is not None and eager.timing_profile is not None
    assert callback.timing_profile.fingerprint == eager.timing_profile.fingerprint
    assert callback.timing_profile.names == eager.timing_profile.names
