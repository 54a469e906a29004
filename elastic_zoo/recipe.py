"""What the recipes share: building every part from the config, with every problem found up front.

`build` instantiates the data module, the network, the LightningModule, the callback, the logger and the
Trainer from a composed config. It does not stop at the first problem: it tries every part, checks what the
config says against what this machine has (data, weights, image size), and raises one `ConfigError` that
lists everything wrong before any data is read or any step is taken. The recipes (`recipes/*.py`) import it
from this package, so they and the tests find it from any working directory.
"""

from __future__ import annotations

import fnmatch
import logging
import math
import pickle
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.loggers import Logger
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch import nn
from typing_extensions import override

from elastic_zoo.data import ClassificationData
from elastic_zoo.method import Elastic, FineTuningMethod, Full, MethodSetup
from lightning_elastic.errors import ElasticConfigError, is_positive_int

T = TypeVar("T")
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
MAX_SEED = 2**32 - 1  # NumPy's seeds are uint32

# Errors that a wrong setting or a missing file causes: reported as a message, never as a stack trace.
CONFIG_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,
    TypeError,
    OSError,
    ImportError,
    RuntimeError,
    pickle.UnpicklingError,
    MisconfigurationException,
    InstantiationException,
    OmegaConfBaseException,
)


class ConfigError(ValueError):
    """Everything wrong with a config, found before any work starts; one line per problem.

    Example:
        >>> print(ConfigError(["`a` is wrong", "`b` too"]))
        The configuration has 2 problems; nothing was run:
          - `a` is wrong
          - `b` too
        docs/errors.md says what to do about each.
    """

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        count = "1 problem" if len(problems) == 1 else f"{len(problems)} problems"
        lines = [f"The configuration has {count}; nothing was run:", *(f"  - {p}" for p in problems)]
        super().__init__("\n".join([*lines, "docs/errors.md says what to do about each."]))


def exit_on_config_error(run: Callable[[DictConfig], object], cfg: DictConfig) -> None:
    """Run a recipe's `run(cfg)` for its command line: a wrong setting ends it with its message and exit status 2.

    That covers the config checked up front (`ConfigError`) and the callback's settings that fail against the
    model, data or device once `fit` starts (`ElasticConfigError`: an unreachable speedup, say). Anything else
    is a bug and keeps its stack trace.
    """
    try:
        run(cfg)
    except (ConfigError, ElasticConfigError) as err:
        print(err, file=sys.stderr)
        raise SystemExit(2) from None


@dataclass
class Parts:
    """Everything a run needs, built from one config."""

    datamodule: ClassificationData
    module: L.LightningModule
    callbacks: list[L.Callback]
    logger: Logger | None
    trainer: L.Trainer
    method: FineTuningMethod

    def prepare_method(self) -> MethodSetup:
        """Hand the method's own callbacks to the trainer, before `fit` (static_last_k profiles here, offline)."""
        setup = self.method.prepare(self.module, self.datamodule)
        self.callbacks.extend(setup.callbacks)
        self.trainer.callbacks.extend(setup.callbacks)  # type: ignore[attr-defined]
        return setup


class Problems:
    """Collects what goes wrong while building the parts, labelled by the config group it comes from."""

    def __init__(self) -> None:
        self.messages: list[str] = []

    def add(self, group: str, message: str) -> None:
        self.messages.append(f"{group}: {message}")

    def attempt(self, group: str, build: Callable[[], T]) -> T | None:
        """`build()`, or None with its error recorded when it fails the way a wrong setting makes it fail."""
        try:
            return build()
        except CONFIG_ERRORS as err:
            self.add(group, _message(err))
            return None


def _message(err: BaseException) -> str:
    """The user-facing text of an error: Hydra's instantiation errors wrap the target's own error."""
    while isinstance(err, InstantiationException) and err.__cause__ is not None:
        err = err.__cause__
    text = str(err).strip() or type(err).__name__
    return text.replace("\n", " ")


def seed_everything(cfg: DictConfig, workers: bool = False) -> None:
    """Seed Python, NumPy and torch with `seed` (Lightning's `seed_everything`), when it is a valid seed.

    A recipe seeds before checking its config (the model's new head is drawn while it is built): `check_settings`
    reports any other value.
    """
    if _valid_seed(cfg.get("seed")):
        L.seed_everything(cfg.seed, workers=workers, verbose=False)


def set_threads(cfg: DictConfig) -> None:
    """Apply `device.threads` (PyTorch's intra-op threads), when set to a valid count.

    A recipe may call this before checking its config: `check_settings` reports any other value.
    """
    threads = cfg.device.get("threads")
    if is_positive_int(threads):
        torch.set_num_threads(threads)


def check_settings(cfg: DictConfig) -> list[str]:
    """Problems in plain settings that no constructor checks: the seed, device figures, image size against the model."""
    problems = Problems()
    seed = cfg.get("seed")
    if not _valid_seed(seed):
        problems.add("top level", f"`seed` must be an int from 0 to {MAX_SEED}. Found: {seed!r}")
    threads = cfg.device.get("threads")
    if threads is not None and not is_positive_int(threads):
        problems.add("device", f"`threads` must be a positive int or null. Found: {threads!r}")
    power = cfg.device.get("power_watts")
    if isinstance(power, bool) or not isinstance(power, (int, float)) or not math.isfinite(power) or power <= 0:
        problems.add("device", f"`power_watts` must be a positive number of watts. Found: {power!r}")
    size = cfg.dataset.get("image_size")
    low, high = cfg.model.get("min_image_size"), cfg.model.get("max_image_size")
    if is_positive_int(size) and ((low is not None and size < low) or (high is not None and size > high)):
        allowed = f"exactly {low}" if low == high else f"at least {low}" + (f" and at most {high}" if high else "")
        model = cfg.model.net.get("name") or str(cfg.model.net._target_).rsplit(".", 1)[-1]
        problems.add("dataset", f"`image_size` must be {allowed} for {model}. Found: {size}")
    text_model, text_data = "tokenizer" in cfg.model and cfg.model.tokenizer is not None, "tokenizer" in cfg.dataset
    if text_model != text_data:
        reads, holds = ("texts", "images") if text_model else ("images", "texts")
        problems.add(
            "dataset",
            f"the model reads {reads} but the data set holds {holds}: pair a text model (model=minilm) with a text "
            f"data set (dataset=spam_assassin), an image model with an image data set. Found: "
            f"model={chosen_option(cfg, 'model')}, dataset={chosen_option(cfg, 'dataset')}",
        )
    if OmegaConf.is_missing(cfg.dataset, "root"):
        problems.add("dataset", "`root` must be set: dataset.root=/path/to/images")
    return problems.messages


def build_data_and_module(
    cfg: DictConfig, problems: Problems, need_data: bool = True
) -> tuple[ClassificationData | None, L.LightningModule | None]:
    """The data module and the LightningModule holding the network, or None for each that cannot be built."""
    datamodule: ClassificationData | None = None
    if not OmegaConf.is_missing(cfg.dataset, "root"):
        datamodule = problems.attempt("dataset", lambda: instantiate(cfg.dataset))
    if datamodule is not None and need_data:
        for message in datamodule.missing():
            problems.add("dataset", message)
    # A placeholder class count still lets the model's own problems (weights, name) show.
    num_classes = datamodule.num_classes if datamodule is not None and datamodule.num_classes > 0 else 2
    make_net = problems.attempt("model", lambda: instantiate(cfg.model.net))
    net: nn.Module | None = None
    if make_net is not None:
        net = problems.attempt("model", lambda: make_net(num_classes=num_classes))
    if net is None:
        return datamodule, None
    make_module = problems.attempt("module", lambda: instantiate(cfg.module))
    module = None if make_module is None else problems.attempt("module", lambda: make_module(net, num_classes))
    if module is not None:
        names = [name for name, _ in module.named_parameters()]
        head = str(cfg.model.head)
        if not _matches(names, head):
            problems.add(
                "model",
                f"`head` must match the names of the head's parameters in the LightningModule, such as "
                f"{names[-1]!r}. Found: {head!r}",
            )
        if uses_elastic(cfg):
            unmatched = [str(p) for p in cfg.elastic.get("train_never") or () if not _matches(names, str(p))]
            if unmatched:
                problems.add(
                    "elastic",
                    f"`train_never` patterns must each match parameter names of the LightningModule, such as "
                    f"{names[0]!r}. Found patterns matching nothing: {unmatched}",
                )
    return datamodule, module


def build(cfg: DictConfig) -> Parts:
    """Instantiate every part of a training run, or raise one `ConfigError` listing every problem.

    Example:
        >>> from hydra import compose, initialize_config_dir
        >>> overrides = ["elastic.speedup=0.5", "device.power_watts=0", "paths.output_dir=/tmp/run"]
        >>> with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        ...     cfg = compose("train", overrides=overrides)
        >>> build(cfg)
        Traceback (most recent call last):
        ...
        elastic_zoo.recipe.ConfigError: The configuration has 2 problems; nothing was run:
          - device: `power_watts` must be a positive number of watts. Found: 0
          - elastic: `speedup` must be a finite number > 1. Found: 0.5
        docs/errors.md says what to do about each.
    """
    problems = Problems()
    problems.messages += check_settings(cfg)
    method = build_method(cfg, problems)
    datamodule, module = build_data_and_module(cfg, problems)
    callbacks: list[L.Callback] = []
    if uses_elastic(cfg):
        callback = problems.attempt("elastic", lambda: instantiate(cfg.elastic, _convert_="all"))
        if callback is not None:
            callbacks.append(callback)
    logger: Logger | None = None
    if _enabled(cfg, "logger"):
        logger = problems.attempt("logger", lambda: instantiate(cfg.logger))
    # Objects passed through `instantiate` would be turned into configs: call the partial Trainer instead.
    make_trainer = problems.attempt("trainer", lambda: instantiate(cfg.trainer, _partial_=True))
    trainer = None
    if make_trainer is not None:
        trainer = problems.attempt("trainer", lambda: make_trainer(callbacks=list(callbacks), logger=logger or False))
    if problems.messages:
        raise ConfigError(problems.messages)
    assert datamodule is not None and module is not None and trainer is not None and method is not None
    return Parts(datamodule, module, callbacks, logger, trainer, method)


def build_method(cfg: DictConfig, problems: Problems) -> FineTuningMethod | None:
    """The `method` group's method; with no `method` chosen, elastic (full fine-tuning with `elastic=none`).

    A method that trains with the elastic callback cannot run with `elastic=none`: reported, not ignored.
    """
    if cfg.get("method") is None:
        return Elastic() if _enabled(cfg, "elastic") else Full()
    method = problems.attempt("method", lambda: instantiate(cfg.method))
    if method is not None and not isinstance(method, FineTuningMethod):
        problems.add("method", f"`_target_` must be a `FineTuningMethod` (conf/method/). Found: {cfg.method._target_}")
        return None
    if method is not None and method.uses_elastic and not _enabled(cfg, "elastic"):
        problems.add(
            "method",
            f"`method={method.name}` trains with the `elastic` group's callback, which `elastic=none` turns off: "
            f"drop `elastic=none`, or pick a method without it (method=full trains every tensor). Found: elastic=none",
        )
    return method


def uses_elastic(cfg: DictConfig) -> bool:
    """Whether the fit runs the `elastic` group's callback: the method is elastic (unset: unless `elastic=none`)."""
    if cfg.get("method") is None or not _enabled(cfg, "elastic"):
        return _enabled(cfg, "elastic")
    try:
        method = get_class(str(cfg.method._target_))
    except CONFIG_ERRORS:  # `build_method` reports it
        return False
    return issubclass(method, FineTuningMethod) and method.uses_elastic


def _matches(names: list[str], pattern: str) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for name in names)


def _enabled(cfg: DictConfig, group: str) -> bool:
    """Whether the group's option builds something (`elastic=none` and `logger=none` set `_target_: null`)."""
    node = cfg.get(group)
    return node is not None and node.get("_target_") is not None


def chosen_option(cfg: DictConfig, group: str) -> str:
    """The option picked for a config group (what its `_target_` builds when Hydra is not running)."""
    if HydraConfig.initialized():
        return str(HydraConfig.get().runtime.choices.get(group, "?"))
    node = cfg.get(group)
    target = node.get("_target_") if node is not None else None
    return str(target).rsplit(".", 1)[-1] if target else "?"


def _valid_seed(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_SEED


# Lightning's lines that say nothing about this run (cloud offers, accelerators the machine lacks) and warnings raised
# inside Lightning's own code; the callback's lines and every warning about the user's settings stay.
QUIET_LINES = ("💡 Tip:", "GPU available:", "TPU available:", "HPU available:")
QUIET_WARNINGS = (r"`isinstance\(treespec, LeafSpec\)` is deprecated",)


class _QuietLines(logging.Filter):
    @override
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(QUIET_LINES)


def quiet_console() -> None:
    """Keep Lightning's noise (`QUIET_LINES`, `QUIET_WARNINGS`) off the console, so the recipe's own lines stand out."""
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _QuietLines) for f in logger.filters):
            logger.addFilter(_QuietLines())
    for pattern in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
