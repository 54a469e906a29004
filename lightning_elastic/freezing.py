"""Applying a selection to a model: which tensors may train, `requires_grad` on every tensor, the BatchNorm policy.

`requires_grad=False` is what makes autograd skip a tensor's weight-gradient kernel and stop back-propagation
at the deepest tensor that still needs a gradient; masking gradients would save nothing. Frozen tensors get
`grad=None`, which every torch optimizer skips (weight decay and momentum included), so one optimizer over all
parameters keeps its state for the whole run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from fnmatch import fnmatchcase
from types import CodeType
from typing import Any, Literal, TypeVar

import torch
import torch._dynamo
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_elastic.errors import ElasticConfigError
from lightning_elastic.records import Mask

BnPolicy = Literal["update", "freeze"]
BN_POLICIES: tuple[str, ...] = ("update", "freeze")
T = TypeVar("T")


def tied_names(module: nn.Module) -> dict[str, tuple[str, ...]]:
    """The other names of each parameter that the module holds under several (weight tying), by the name that
    `named_parameters()` gives it.

    Example:
        >>> model = nn.ModuleDict({"emb": nn.Embedding(4, 2), "out": nn.Linear(2, 4, bias=False)})
        >>> model.out.weight = model.emb.weight
        >>> tied_names(model)
        {'emb.weight': ('out.weight',)}
    """
    first: dict[int, str] = {}
    others: dict[str, tuple[str, ...]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in first:
            others[first[id(param)]] = (*others.get(first[id(param)], ()), name)
        else:
            first[id(param)] = name
    return others


def match_patterns(
    names: Sequence[str], patterns: Iterable[str], setting: str, aliases: Mapping[str, Sequence[str]] | None = None
) -> tuple[bool, ...]:
    """Which `names` match any of the shell-style `patterns` (fnmatch, case-sensitive), by the name or by any of its
    `aliases` (a tied parameter's other names, `tied_names`: `out.*` pins a head tied to the embedding).

    Raises ValueError naming `setting` when a pattern matches no name: a typo must not pass silently.

    Example:
        >>> match_patterns(["fc.weight", "fc.bias", "conv.weight"], ["fc.*"], "train_always")
        (True, True, False)
        >>> match_patterns(["emb.weight", "out.bias"], ["out.*"], "train_always", {"emb.weight": ["out.weight"]})
        (True, True)
    """
    patterns, aliases = list(patterns), aliases or {}
    every = [(name, *aliases.get(name, ())) for name in names]
    unmatched = [p for p in patterns if not any(fnmatchcase(n, p) for each in every for n in each)]
    if unmatched:
        listed = [f"{each[0]} (also {', '.join(each[1:])})" if len(each) > 1 else each[0] for each in every]
        shown = ", ".join(listed[:6]) + (", ..." if len(names) > 6 else "")
        raise ElasticConfigError(
            f"`{setting}` patterns must each match at least one trainable parameter name (shell-style, e.g. "
            f"'classifier.*'; names: {shown}). Found patterns matching nothing: {unmatched}"
        )
    return tuple(any(fnmatchcase(n, p) for p in patterns for n in each) for each in every)


def pins(
    names: Sequence[str],
    params: Sequence[nn.Parameter],
    train_always: Iterable[str],
    train_never: Iterable[str],
    aliases: Mapping[str, Sequence[str]] | None = None,
) -> tuple[Mask, Mask]:
    """The tensors every selection trains (`train_always`) and those none trains (`train_never`, or not trainable);
    patterns match a tied parameter by any of its names (`aliases`, `tied_names`).

    Raises:
        ElasticConfigError: a pattern that matches nothing, a tensor pinned both ways, or nothing left to train.

    Example:
        >>> layer = nn.Linear(2, 2)
        >>> pins(["weight", "bias"], [layer.weight, layer.bias], ["bias"], [])
        (Mask(flags=(False, True)), Mask(flags=(False, False)))
    """
    required = Mask.of(match_patterns(names, train_always, "train_always", aliases))
    never = match_patterns(names, train_never, "train_never", aliases)
    forbidden = Mask.of([a or not p.requires_grad for a, p in zip(never, params, strict=True)])
    clash = [n for n, r, f in zip(names, required, forbidden, strict=True) if r and f]
    if clash:
        raise ElasticConfigError(
            f"`train_always` must not name tensors that `train_never` names or that do not require grad. Found: {clash}"
        )
    if all(forbidden):
        raise ElasticConfigError("`train_never` must leave at least one trainable tensor. Found: every tensor excluded")
    return required, forbidden


@dataclass(frozen=True)
class UserState:
    """What the user had before `freeze_never` changed anything: every flag, and the BatchNorm layers it put in eval
    mode. `give_back` puts both back when the fit ends, however it ends."""

    flags: tuple[tuple[nn.Parameter, bool], ...] = ()
    bn_frozen: tuple[str, ...] = ()

    def give_back(self, model: nn.Module) -> None:
        for param, flag in self.flags:
            param.requires_grad_(flag)
        apply_bn_policy(model, "update", self.bn_frozen)


def freeze_never(
    model: nn.Module, train_always: Iterable[str], train_never: Iterable[str], bn_policy: BnPolicy
) -> UserState:
    """Freeze the `train_never` tensors of `model` (and their BatchNorm layers under "freeze") as training starts.

    The patterns are checked against every tensor that requires grad, with the errors of `pins`. Frozen this
    early, a `train_never` tensor is what a tensor the user froze is: the fit's first step and the profile leave it
    out, and no selection can train it.

    Example:
        >>> layer = nn.Linear(2, 2)
        >>> user = freeze_never(layer, [], ["bias"], "update")
        >>> layer.bias.requires_grad, [flag for _, flag in user.flags]
        (False, [True, True])
        >>> user.give_back(layer)
        >>> layer.bias.requires_grad
        True
    """
    flags = tuple((p, p.requires_grad) for p in model.parameters())
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    trainable = [p for _, p in named]
    _, forbidden = pins([n for n, _ in named], trainable, train_always, train_never, tied_names(model))
    apply_mask(trainable, [not f for f in forbidden])
    return UserState(flags, tuple(apply_bn_policy(model, bn_policy)))


def apply_mask(params: Sequence[nn.Parameter], mask: Sequence[bool]) -> int:
    """Set `requires_grad` of `params[k]` to `mask[k]`; frozen tensors lose their gradient.

    Returns how many tensors changed state.

    Example:
        >>> layer = nn.Linear(2, 2)
        >>> apply_mask([layer.weight, layer.bias], [False, True])
        1
        >>> layer.weight.requires_grad, layer.bias.requires_grad
        (False, True)
    """
    if len(params) != len(mask):
        raise ValueError(f"`mask` must have one entry per parameter ({len(params)}). Found: {len(mask)}")
    changed = 0
    for param, train in zip(params, mask, strict=True):
        if param.requires_grad != train:
            param.requires_grad_(train)
            changed += 1
        if not train:
            param.grad = None
    return changed


def refuse_changed(params: Sequence[nn.Parameter], expected: Sequence[bool], names: Sequence[str]) -> None:
    """Refuse `requires_grad` flags that differ from those the callback set (`expected`): a trainable set that
    something else changed would escape the plan and the selection.

    Raises:
        ElasticConfigError: naming (up to 5 of) the tensors whose flag changed.
    """
    changed = [k for k, (p, e) in enumerate(zip(params, expected, strict=True)) if p.requires_grad != e]
    if changed:
        raise ElasticConfigError(
            "`ElasticTensorSelection` must be the only one to set `requires_grad` during the fit (another "
            "callback, e.g. `BackboneFinetuning`, or the module changed it; freeze for good with `train_never` "
            f"instead). Found changed outside the callback: {[names[k] for k in changed[:5]]}"
        )


def apply_bn_policy(model: nn.Module, policy: BnPolicy, previously_frozen: Iterable[str] = ()) -> list[str]:
    """Under `policy="freeze"`, put every BatchNorm layer whose own tensors are all frozen in eval mode.

    In eval mode a frozen BatchNorm normalises with its running statistics and stops updating them, so the
    frozen part of the network is a fixed function (and its forward pass is a little cheaper). Under "update"
    (PyTorch's default), BatchNorm layers follow the model's train/eval mode whatever their tensors do.
    Returns the names of the layers it holds in eval mode: those it switches now (from train mode) and those of
    `previously_frozen` that still qualify. Layers of `previously_frozen` that no longer qualify go back to the model's
    mode (train mode, the mode they had when it switched them, during training); no other layer's mode is touched, so
    a layer the user left in eval mode stays there.

    Example:
        >>> bn = nn.BatchNorm1d(3)
        >>> _ = bn.requires_grad_(False)
        >>> apply_bn_policy(nn.Sequential(bn), "freeze"), bn.training
        (['0'], False)
    """
    if policy not in BN_POLICIES:
        raise ValueError(f"`bn_policy` must be one of {BN_POLICIES}. Found: {policy!r}")
    frozen: list[str] = []
    previously = set(previously_frozen)
    for name, module in model.named_modules():
        if not isinstance(module, nn.modules.batchnorm._BatchNorm):
            continue
        own = list(module.parameters(recurse=False))
        qualifies = policy == "freeze" and bool(own) and not any(p.requires_grad for p in own)
        if qualifies and (module.training or name in previously):
            module.eval()
            frozen.append(name)
        elif name in previously:
            module.train(model.training)  # train mode, but when the fit ends inside a validation (eval everywhere)
    return frozen


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled in this process so far (dynamo's own counter)."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


# The torch internals `CompiledCodes` reads (no public API tells which codes a fit compiled, nor resets one code).
COMPILE_LOCK = "torch._dynamo.convert_frame.compile_lock"
SEEN_CODES = "torch._dynamo.convert_frame.input_codes.seen"
CACHE_ENTRIES = "torch._C._dynamo.eval_frame._debug_get_cache_entry_list"
RESET_CODE = "torch._C._dynamo.eval_frame.reset_code"
INTERNALS = (COMPILE_LOCK, SEEN_CODES, CACHE_ENTRIES, RESET_CODE)
# What using an internal raises when a torch upgrade changed its signature or behaviour.
CHANGED = (TypeError, AttributeError, RuntimeError)


class InternalFailed(Exception):
    """One of the `INTERNALS` raised one of `CHANGED` when `CompiledCodes` used it.

    Attributes:
        internal: the internal's dotted path.
        error: what it raised.
    """

    def __init__(self, internal: str, error: Exception) -> None:
        super().__init__(f"{internal} raised {type(error).__name__}: {error}")
        self.internal, self.error = internal, error


class CompiledCodes:
    """The code objects whose torch.compile cache this fit's steps filled, so that a new selection empties theirs only.

    Dynamo keeps compiled graphs per code object (a function's, a resume function's after a graph break), each entry
    guarded on `requires_grad`: a stale graph never runs, but every new trainable set adds an entry, and past
    `torch._dynamo.config.recompile_limit` entries for the module dynamo falls back to eager mode for good. So each
    change of the trainable set empties the caches of the codes that gained entries between a change (`watch`) and
    the end of the next optimizer step (`collect`): the step compiles one graph per compiled region, charged to the
    fit as warm-up. Only those codes are reset (`torch._C._dynamo.eval_frame.reset_code`), not dynamo as a whole
    (`torch._dynamo.reset()` drops every compiled function and model of the process). Shared codes are reset with
    all their entries: a compiled submodule runs through torch's one `wrap_inline` frame, which every compiled
    module without hooks shares, and a class's `training_step` is shared by its instances (docs/compatibility.md).

    A torch without one of the `INTERNALS` this reads (`missing`), or whose internal raises one of `CHANGED` when
    used (`failed`: its signature or behaviour changed), gets what is still correct: each reset from then on is
    `torch._dynamo.reset()`, with a warning (once) that names the internal, what failed and what that costs. Any
    other error, and any error outside the internals' use, propagates.

    Example:
        >>> codes = CompiledCodes()
        >>> codes.collect()  # nothing compiled since: no code is the fit's
        >>> codes.codes, codes.missing, codes.failed
        (set(), (), None)
    """

    def __init__(self) -> None:
        self.codes: set[CodeType] = set()
        self.missing = tuple(name for name in INTERNALS if _internal(name) is None)
        self.failed: InternalFailed | None = None
        self._warned = False
        self._entries = self._cache_entries()

    def watch(self) -> None:
        """The trainable set changed: what compiles from here until `collect` is this fit's."""
        self._entries = self._cache_entries()

    def collect(self) -> None:
        """Keep the codes that gained cache entries since `watch`."""
        self.codes.update(code for code, n in self._cache_entries().items() if n > self._entries.get(code, 0))

    def reset(self) -> None:
        """Empty the caches of the fit's codes; the next step compiles them afresh (and is watched)."""
        if self._reset_codes():
            self.watch()
            return
        self._warn_fallback()
        torch._dynamo.reset()

    def _reset_codes(self) -> bool:
        """Reset only the fit's codes; False when this torch cannot (an internal missing or failing)."""
        if self.missing or self.failed:
            return False
        try:
            with ExitStack() as locked:  # as torch's own resets do: no compile runs meanwhile
                _use(COMPILE_LOCK, locked.enter_context, _internal(COMPILE_LOCK))
                reset_code = _internal(RESET_CODE)
                for code in self.codes:
                    _use(RESET_CODE, reset_code, code)
        except InternalFailed as failed:
            self.failed = failed
            return False
        return True

    def _cache_entries(self) -> dict[CodeType, int]:
        """Every code object dynamo has seen, with the number of compiled entries in its cache (none known when
        this torch lacks the internals, or one failed)."""
        if self.missing or self.failed:
            return {}
        entries = _internal(CACHE_ENTRIES)  # looked up once, not once per code
        try:
            codes = _use(SEEN_CODES, lambda seen: [ref() for ref in seen], _internal(SEEN_CODES))
            return {code: _use(CACHE_ENTRIES, lambda c: len(entries(c)), code) for code in codes if code is not None}
        except InternalFailed as failed:
            self.failed = failed
            return {}

    def _warn_fallback(self) -> None:
        if self._warned:
            return
        self._warned = True
        if self.failed is None:
            cannot = f"lacks {', '.join(self.missing)}, with which"
        else:
            cannot = f"has {self.failed.internal}, but using it raised {type(self.failed.error).__name__}: "
            cannot += f"{self.failed.error} (its signature or behaviour changed); with it"
        rank_zero_warn(
            f"ElasticTensorSelection: this torch ({torch.__version__}) {cannot} a change of the trainable set resets "
            "only the code the fit compiled. Each change resets all of dynamo instead (`torch._dynamo.reset()`): the "
            "fit's graphs compile again as before, and so does every other function or model compiled in this "
            "process, the next time it runs (see docs/compatibility.md)."
        )


def _use(internal: str, function: Callable[..., T], *args: Any) -> T:
    """`function(*args)`, a use of `internal`: what it raises of `CHANGED` as `InternalFailed`, the rest as it is."""
    try:
        return function(*args)
    except CHANGED as error:
        raise InternalFailed(internal, error) from error


def _internal(dotted: str) -> Any:
    """The torch object at the dotted path `dotted`, or None when this torch has none there."""
    found: Any = torch
    for name in dotted.split(".")[1:]:
        found = getattr(found, name, None)
        if found is None:
            return None
    return found


def is_compiled(model: nn.Module) -> bool:
    """Whether torch.compile runs `model` or part of it: passed compiled to `fit`, a submodule wrapped by
    `torch.compile`, or one compiled in place (`Module.compile()`, which leaves the module's type as it was)."""
    return bool(getattr(model, "_compiler_ctx", None)) or any(
        type(m).__name__ == "OptimizedModule" or getattr(m, "_compiled_call_impl", None) is not None
        for m in model.modules()
    )
