"""The `TimingProfile` type, its validation and its cache."""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.checkpoint
from torch import Tensor, nn

from lightning_elastic.profiling import TimingProfile, profile
from lightning_elastic.profiling.cache import cache_file, cache_key, device_name, remember_step
from lightning_elastic.profiling.profile import mismatch, read_profile, store
from tests.unit.profiling.fakes import small


def test_cache_hit_reuses_the_stored_profile(tmp_path: Path) -> None:
    net, loss_fn = small()
    first = profile(net, loss_fn, cache_dir=tmp_path, repeats=1)
    files = list(tmp_path.iterdir())
    assert len(files) == 1 and files[0].suffix == ".json"
    calls = 0

    def counting() -> Tensor:
        nonlocal calls
        calls += 1
        return loss_fn()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = profile(net, counting, cache_dir=tmp_path, repeats=1)
    assert second == first
    assert calls == 1  # one forward pass to fingerprint the inputs, no measurement


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda d: {**d, "version": 0}, "stale"),
        (lambda d: {**{k: v for k, v in d.items() if k != "shapes"}, "version": 1}, "stale"),  # before `shapes`
        (lambda d: {**d, "fingerprint": "0" * 64}, "does not match"),
        (lambda d: {**d, "t_dw": "oops"}, "corrupt"),
        (None, "corrupt"),
    ],
)
def test_bad_cache_file_is_reported_and_replaced(
    tmp_path: Path, damage: Callable[[dict[str, Any]], dict[str, Any]] | None, reason: str
) -> None:
    net, loss_fn = small()
    first = profile(net, loss_fn, cache_dir=tmp_path, repeats=1)
    (path,) = tmp_path.iterdir()
    if damage is None:
        path.write_text('{"version": 1, "names": [')
    else:
        path.write_text(json.dumps(damage(json.loads(path.read_text()))))
    with pytest.warns(UserWarning, match=reason) as record:
        again = profile(net, loss_fn, cache_dir=tmp_path, repeats=1)
    assert str(path) in str(record[0].message)
    assert again.fingerprint == first.fingerprint
    assert TimingProfile.from_dict(json.loads(path.read_text())) == again
    assert list(tmp_path.iterdir()) == [path]  # overwritten in place, no temporary file left


def test_fingerprint_depends_on_input_shape(tmp_path: Path) -> None:
    net, _ = small()
    a = profile(net, lambda: net(torch.randn(8, 16)).sum(), cache_dir=tmp_path, repeats=1)
    b = profile(net, lambda: net(torch.randn(5, 16)).sum(), cache_dir=tmp_path, repeats=1)
    assert a.fingerprint != b.fingerprint
    assert len(list(tmp_path.iterdir())) == 2


def test_predict_and_from_dict_validate() -> None:
    prof = TimingProfile(("a", "b"), (1.0, 2.0), (0.0, 1.0), 3.0, 7.0, "cpu", "f", (), "measured", (1, 2))
    with pytest.raises(ValueError, match=r"`mask` must have one entry per profiled tensor \(2\). Found: 3"):
        prof.predict([True, False, True])
    data = prof.to_dict()
    with pytest.raises(ValueError, match=r'`data\["t_fw"\]` must be a number'):
        TimingProfile.from_dict({**data, "t_fw": "x"})
    with pytest.raises(ValueError, match="`t_dy` has 1 entries"):
        TimingProfile.from_dict({**data, "t_dy": [0.0]})
    with pytest.raises(ValueError, match="finite number >= 0"):
        TimingProfile.from_dict({**data, "t_full": -1.0})
    # a forward longer than its step: a busy machine's timings, refused (a cache entry of them is measured again)
    with pytest.raises(ValueError, match=r"`t_fw` must be at most `t_full` \(the forward is part of the step\), got 8.0"):
        TimingProfile.from_dict({**data, "t_fw": 8.0})


class _Switchable(nn.Module):
    """Two blocks whose activation and gradient checkpointing can change without touching any parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(16, 32)
        self.second = nn.Linear(32, 4)
        self.activation: Callable[[Tensor], Tensor] = torch.relu
        self.checkpointing = False

    def gradient_checkpointing_enable(self) -> None:
        self.checkpointing = True

    def _block(self, x: Tensor) -> Tensor:
        return self.activation(self.first(x))

    def forward(self, x: Tensor) -> Tensor:
        if self.checkpointing:
            h = torch.utils.checkpoint.checkpoint(self._block, x, use_reentrant=False)
        else:
            h = self._block(x)
        return self.second(h)


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda net: net.gradient_checkpointing_enable(), id="gradient checkpointing"),
        pytest.param(lambda net: setattr(net, "activation", torch.tanh), id="a functional op"),
    ],
)
def test_fingerprint_depends_on_the_graph(tmp_path: Path, change: Callable[[_Switchable], None]) -> None:
    """Same parameters, same module calls, another graph: its costs differ, so its cached profile does too."""
    torch.manual_seed(0)
    net = _Switchable()
    x = torch.randn(8, 16)
    plain = profile(net, lambda: net(x).sum(), cache_dir=tmp_path, repeats=1)
    change(net)
    changed = profile(net, lambda: net(x).sum(), cache_dir=tmp_path, repeats=1)
    assert changed.fingerprint != plain.fingerprint
    assert len(list(tmp_path.iterdir())) == 2
    again = profile(net, lambda: net(x).sum(), cache_dir=tmp_path, repeats=1)
    assert again == changed  # the changed model's own profile is found in the cache


def test_a_fits_steady_step_goes_into_the_cache_entry_of_its_profile_and_nowhere_else(tmp_path: Path) -> None:
    """`remember_step` writes `t_step` into the entry of the profile's fingerprint and changes nothing else in it (the
    profile it is given may be the user's, with other timings); a profile with no entry (given by the user, or no
    cache) enters none. Files written before `t_step` existed read as 0 (not known)."""
    net, loss_fn = small()
    cached = profile(net, loss_fn, cache_dir=tmp_path, repeats=1)
    path = cache_file(tmp_path, cached.fingerprint)
    given = dataclasses.replace(cached, t_full=2 * cached.t_full)  # the same model's profile, timed elsewhere
    remember_step(tmp_path, given, 0.25, 0.05)
    assert read_profile(path) == dataclasses.replace(cached, t_step=0.25, t_update=0.05)
    assert profile(net, loss_fn, cache_dir=tmp_path, repeats=1).t_step == 0.25  # what the next process reads
    remember_step(tmp_path, given, 0.25, math.inf)  # an update not measured is kept as not known
    assert read_profile(path).t_update == 0.0
    remember_step(tmp_path, given, 0.25, 0.25)  # no update takes the whole step it is part of: not a measurement
    assert read_profile(path).t_update == 0.0
    other = dataclasses.replace(cached, fingerprint="f" * 64)
    remember_step(tmp_path, other, 0.5)
    remember_step(None, cached, 0.5)
    remember_step(tmp_path, cached, math.nan)
    assert not cache_file(tmp_path, other.fingerprint).exists() and read_profile(path).t_step == 0.25
    older = {k: v for k, v in cached.to_dict().items() if k not in ("t_step", "t_update")}
    assert TimingProfile.from_dict(older).t_step == 0.0 and TimingProfile.from_dict(older).t_update == 0.0
    with pytest.raises(ValueError, match=r'`data\["t_step"\]` must be a number'):
        TimingProfile.from_dict({**older, "t_step": "fast"})
    with pytest.raises(ValueError, match=r'`data\["t_update"\]` must be a number'):
        TimingProfile.from_dict({**older, "t_step": 0.5, "t_update": "fast"})
    with pytest.raises(ValueError, match="`t_update` must be at most `t_step`"):
        TimingProfile.from_dict({**older, "t_step": 0.5, "t_update": 0.6})


def test_a_cache_entry_that_cannot_keep_the_steady_step_is_left_as_it_is_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A corrupt entry, or a cache the process cannot write (a read-only mount: `store` raising), warns and leaves the
    file as it was; the fit goes on. Before: the write's error ended the fit at its first selection."""
    net, loss_fn = small()
    cached = profile(net, loss_fn, cache_dir=tmp_path, repeats=1)
    path = cache_file(tmp_path, cached.fingerprint)

    def read_only(*args: Any) -> None:
        raise PermissionError(13, "Read-only file system")

    monkeypatch.setattr(importlib.import_module("lightning_elastic.profiling.cache"), "store", read_only)
    with pytest.warns(UserWarning, match=r"could not keep this fit's steady full step \(\[Errno 13\] Read-only"):
        remember_step(tmp_path, cached, 0.25)
    assert read_profile(path) == cached
    path.write_text("{not json")
    with pytest.warns(UserWarning, match="could not keep this fit's steady full step"):
        remember_step(tmp_path, cached, 0.25)
    assert path.read_text() == "{not json"


def test_shapes_are_measured_and_go_through_the_profile_file(tmp_path: Path) -> None:
    """A measured profile records each tensor's shape; the one writer and reader keep them, and a hand-built profile
    without them (`shapes=None`) reads back as it was."""
    net, loss_fn = small()
    measured = profile(net, loss_fn, repeats=1)
    named = dict(net.named_parameters())
    assert measured.shapes == tuple(tuple(named[name].shape) for name in measured.names)
    path = tmp_path / "profile.json"
    store(path, measured)
    assert read_profile(path) == measured
    assert json.loads(path.read_text())["shapes"] == [list(named[name].shape) for name in measured.names]
    hand_built = TimingProfile(("a",), (1.0,), (0.0,), 2.0, 3.0, "cpu", "f", (), "measured", (4,))
    assert hand_built.shapes is None
    store(path, hand_built)
    assert read_profile(path) == hand_built


def test_shapes_must_agree_with_the_element_counts() -> None:
    with pytest.raises(ValueError, match=r"`shapes\[0\]` has 6 elements, `numel\[0\]` is 4"):
        TimingProfile(("a",), (1.0,), (0.0,), 2.0, 3.0, "cpu", "f", (), "measured", (4,), shapes=((2, 3),))
    with pytest.raises(ValueError, match="`shapes` has 2 entries, `names` has 1"):
        TimingProfile(("a",), (1.0,), (0.0,), 2.0, 3.0, "cpu", "f", (), "measured", (4,), shapes=((4,), (4,)))
    data = TimingProfile(("a",), (1.0,), (0.0,), 2.0, 3.0, "cpu", "f", (), "measured", (4,), shapes=((4,),)).to_dict()
    with pytest.raises(ValueError, match=r'`data\["shapes"\]` must be a list of lists of int, or null'):
        TimingProfile.from_dict({**data, "shapes": [4]})


def test_a_tensor_reshaped_to_the_same_element_count_is_a_mismatch_naming_both_shapes() -> None:
    """A Linear(6, 4) profile for a Linear(4, 6): names and element counts agree, shapes (and costs) do not."""
    profiled = nn.Linear(6, 4, bias=False)
    measured = profile(profiled, lambda: profiled(torch.randn(8, 6)).sum(), repeats=1)
    assert mismatch(measured, profiled) is None
    assert mismatch(measured, nn.Linear(4, 6, bias=False)) == (
        "shapes that differ: ['weight ((4, 6) profiled, (6, 4) in the module)']"
    )
    assert mismatch(dataclasses.replace(measured, shapes=None), nn.Linear(4, 6, bias=False)) is None  # counts only


def test_a_profile_taken_on_one_gpu_has_the_key_of_its_alike_and_not_of_another_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    models = {0: "NVIDIA A100", 1: "NVIDIA A100", 2: "NVIDIA T4"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: models[index])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    first, second, other = (torch.device("cuda", i) for i in range(3))
    assert device_name(first) == device_name(second) == device_name(torch.device("cuda")) == "cuda (NVIDIA A100)"
    assert device_name(other) == "cuda (NVIDIA T4)"
    key = lambda device: cache_key({"step": 1}, device, [], "measured")  # noqa: E731
    assert key(first) == key(second) != key(other)
