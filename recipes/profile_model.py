"""Profile a model's per-tensor training times on this device, print the table and save it.

    python recipes/profile_model.py                                         # EfficientNet-Lite0, ELPV's shape, CPU
    python recipes/profile_model.py model=resnet50 model.net.pretrained=false dataset=cub200 dataset.batch_size=4
    python recipes/profile_model.py model=minilm dataset=spam_assassin          # a transformer on texts

Composes `conf/profile.yaml`, builds the LightningModule as `recipes/train.py` would (the data set gives only the
number of classes, the batch size and an input's size: no image or text is read), and times the module's own
`training_step` on a made-up batch of the fit's shapes and dtypes with `lightning_elastic.profile`: the step a fit
runs, so that the profile has that step's fingerprint. Writes `profile.md` (the table) and `profile.json` (the
figures) to the run's output folder (`profile.json` as the library writes every profile: `+elastic.profile=<its
path>` reads it); with `paths.cache_dir` set, a later training run with the same settings on the same device reuses
the profile.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import get_args

import hydra
import torch
from omegaconf import DictConfig
from torch import Tensor

from elastic_zoo.recipe import (
    ConfigError,
    Problems,
    build_data_and_module,
    check_settings,
    exit_on_config_error,
    quiet_console,
    seed_everything,
    set_threads,
)
from lightning_elastic import TimingProfile, profile
from lightning_elastic.inspection import profile_table
from lightning_elastic.profiling import TimingMethod
from lightning_elastic.profiling.profile import store

# Lightning precision settings -> the autocast dtype a training step runs under (None: no autocast).
AUTOCAST: dict[str, torch.dtype | None] = {
    "32-true": None,
    "32": None,
    "16-mixed": torch.float16,
    "bf16-mixed": torch.bfloat16,
}


@hydra.main(config_path="../conf", config_name="profile", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """The command line: a config problem ends the run with its message (exit status 2), not a stack trace."""
    exit_on_config_error(run, cfg)


def run(cfg: DictConfig) -> TimingProfile:
    """Check the config, build the module, profile it; print the table and write it to the output folder."""
    quiet_console()
    seed_everything(cfg)
    set_threads(cfg)
    problems = Problems()
    problems.messages += check_settings(cfg)
    precision = str(cfg.device.precision)
    if precision not in AUTOCAST:
        problems.add("device", f"`precision` must be one of {tuple(AUTOCAST)} to profile. Found: {precision!r}")
    accelerator = str(cfg.device.accelerator)
    if accelerator in ("cuda", "gpu") and not torch.cuda.is_available():
        problems.add("device", f"`accelerator` is {accelerator!r} but PyTorch sees no CUDA device: use device=cpu")
    if cfg.time_model not in get_args(TimingMethod):
        problems.add("top level", f"`time_model` must be one of {get_args(TimingMethod)}. Found: {cfg.time_model!r}")
    datamodule, module = build_data_and_module(cfg, problems, need_data=False)
    if problems.messages:
        raise ConfigError(problems.messages)
    assert datamodule is not None and module is not None
    device = torch.device("cuda" if accelerator in ("cuda", "gpu") else "cpu")
    module = module.to(device).train()
    inputs, shape = made_up_inputs(datamodule, int(cfg.dataset.batch_size), cfg.dataset.get("image_size"))
    inputs = inputs.to(device)
    labels = torch.randint(datamodule.num_classes, (len(inputs),), device=device)
    dtype = AUTOCAST[precision]

    def compute_loss() -> Tensor:
        autocast = torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()
        with autocast:
            return module.training_step((inputs, labels), 0)

    with warnings.catch_warnings():  # the step's `self.log` calls: no Trainer here, nothing to log
        warnings.filterwarnings("ignore", message=r"You are trying to `self.log\(\)`")
        profiled = profile(module, compute_loss, method=cfg.time_model, cache_dir=cfg.paths.cache_dir)
    table = profile_table(profiled)
    output_dir = Path(cfg.paths.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "profile.md").write_text(table + "\n")
    store(output_dir / "profile.json", profiled)  # the profile format's one writer: `profile=` and the cache read it
    print(table)
    print(
        f"\n{len(profiled.names)} tensors on {profiled.device} ({profiled.method}): full step "
        f"{profiled.t_full * 1e3:.1f} ms, forward {profiled.t_fw * 1e3:.1f} ms, batch of {shape}.\n"
        f"Saved: {output_dir / 'profile.md'} and profile.json"
    )
    return profiled


def made_up_inputs(datamodule: object, batch: int, image_size: int | None) -> tuple[Tensor, str]:
    """A batch of inputs of the shape and dtype the data set gives the module, and its shape in words: random images
    (N, 3, S, S) for an image data set, else the token ids (N, max_length) its tokenizer makes of a made-up text.

    Example:
        >>> inputs, shape = made_up_inputs(None, 2, 8)
        >>> inputs.dtype, shape
        (torch.float32, '2 x 3 x 8 x 8')
    """
    if image_size is not None:
        inputs = torch.randn(batch, 3, int(image_size), int(image_size))
    else:
        tokenize = getattr(datamodule, "tokenizer", None)
        if not callable(tokenize):
            kind = type(datamodule).__name__
            raise ConfigError([f"dataset: `image_size` must be a positive int for {kind} (no tokenizer). Found: None"])
        inputs = tokenize(["a made-up text to profile the step on"] * batch)
    return inputs, " x ".join(str(n) for n in inputs.shape)


if __name__ == "__main__":
    main()
