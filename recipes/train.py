"""Fine-tune a pretrained model with elastic tensor selection, then test it and print a short summary.

    python recipes/train.py experiment=demo                  # EfficientNet-Lite0 x ELPV, offline (`make demo`)
    python recipes/train.py experiment=demo elastic=none     # the same, training every tensor (the baseline)
    python recipes/train.py experiment=demo method=bitfit    # the same, one of the baselines (conf/method/)
    python recipes/train.py model=resnet50 dataset=cub200 elastic.speedup=3 trainer.max_epochs=20

Composes `conf/train.yaml` with the groups and overrides given, checks the whole config up front (one message
listing every problem), fits, tests, and prints: test accuracy, wall time, the fit's speedup against training every
tensor (the callback itself logs the whole comparison, `summary.FitSummary`, as the fit ends: it is not repeated),
an energy estimate (wall time x the device config's power figure) and where the TensorBoard logs are. The summary is
also written to `summary.json` in the run's output folder (strict JSON: a figure not measured is null), and the
selection map, when there is one, to `selection_map.png`; Lightning's noise is kept off the console.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from PIL import Image

from elastic_zoo.recipe import Parts, build, exit_on_config_error, quiet_console, seed_everything, set_threads
from lightning_elastic import ElasticTensorSelection
from lightning_elastic.summary import FitSummary


@hydra.main(config_path="../conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """The command line: a config problem ends the run with its message (exit status 2), not a stack trace."""
    exit_on_config_error(run, cfg)


def run(cfg: DictConfig) -> tuple[dict[str, Any], Parts]:
    """Check and instantiate everything, fit, test; print the summary and write it to `summary.json`.

    Returns the summary and the trained parts.
    """
    started = time.perf_counter()
    quiet_console()
    seed_everything(cfg, workers=True)
    set_threads(cfg)
    parts = build(cfg)
    parts.prepare_method()
    parts.trainer.fit(parts.module, datamodule=parts.datamodule)
    results = parts.trainer.test(parts.module, datamodule=parts.datamodule, verbose=False)
    summary = summarise(cfg, parts, results[0] if results else {}, time.perf_counter() - started)
    if parts.trainer.is_global_zero:  # under DDP every rank gets here; one summary is enough
        output_dir = Path(cfg.paths.output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        for callback in parts.callbacks:
            if isinstance(callback, ElasticTensorSelection) and (image := callback.selection_map()) is not None:
                Image.fromarray(image).save(output_dir / "selection_map.png")
                summary["run_files"] = [*summary["run_files"], "selection_map.png"]
        (output_dir / "summary.json").write_text(json.dumps(plain_json(summary), indent=2, allow_nan=False) + "\n")
        print(format_summary(summary))
    return summary, parts


def summarise(cfg: DictConfig, parts: Parts, test: Mapping[str, float], wall_seconds: float) -> dict[str, Any]:
    """The run's figures as plain data: accuracy, wall time, speedup, energy estimate, where the logs are."""
    power = float(cfg.device.power_watts)
    summary: dict[str, Any] = {
        "model": _choice("model"),
        "dataset": _choice("dataset"),
        "device": _choice("device"),
        "elastic": _choice("elastic"),
        "method": parts.method.name,
        "test_accuracy": float(test.get("test/acc", math.nan)),
        "test_images": len(parts.datamodule.test_dataloader().dataset),  # type: ignore[arg-type]
        "epochs": parts.trainer.current_epoch,
        "wall_seconds": wall_seconds,
        "power_watts": power,
        "energy_wh_estimate": wall_seconds * power / 3600.0,
        "target_speedup": math.nan,
        "tensorboard_dir": None,
        "output_dir": str(cfg.paths.output_dir),
        "run_files": ["config", "log", "summary.json"],
    }
    for callback in parts.callbacks:
        if isinstance(callback, ElasticTensorSelection):
            summary["target_speedup"] = float(cfg.elastic.speedup)
            summary.update(callback.summary())
            summary["elastic_report"] = callback.report().to_dict()
    log_dir = parts.logger.log_dir if parts.logger is not None else None
    if log_dir is not None and Path(log_dir).is_dir():  # fast_dev_run replaces loggers and writes nothing
        summary["tensorboard_dir"] = str(Path(log_dir))
    return summary


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as a few aligned lines for the terminal.

    Example:
        >>> print(format_summary({"model": "tiny", "dataset": "elpv", "device": "cpu", "elastic": "none",
        ...     "method": "full", "test_accuracy": 0.5, "test_images": 10, "epochs": 1, "wall_seconds": 72.0,
        ...     "power_watts": 10.0, "energy_wh_estimate": 0.2, "tensorboard_dir": None, "output_dir": "out"}))
        <BLANKLINE>
        Summary: tiny x elpv on cpu, method=full, 1 epoch(s)
          test accuracy      0.5000 (10 test images)
          wall time          72 s (1.2 min), data loading and testing included
          measured speedup   n/a: method=full runs no elastic selection
          energy (estimate)  0.20 Wh = 72 s x 10 W (device.power_watts: an estimate, not a measurement)
          TensorBoard        none (no logger, or fast_dev_run)
          run folder         out (config, log, summary.json)
    """
    wall = summary["wall_seconds"]
    lines = [
        "",
        f"Summary: {summary['model']} x {summary['dataset']} on {summary['device']}, method={summary['method']}, "
        f"{summary['epochs']} epoch(s)",
        f"  test accuracy      {summary['test_accuracy']:.4f} ({summary['test_images']} test images)",
        f"  wall time          {wall:.0f} s ({wall / 60:.1f} min), data loading and testing included",
    ]
    speedup = summary.get("measured_speedup", math.nan)
    if summary["method"] != "elastic":
        lines.append(f"  measured speedup   n/a: method={summary['method']} runs no elastic selection")
    elif math.isfinite(speedup):  # the callback logged its table at fit end: one line here, not the table again
        headline = FitSummary(**summary["elastic_report"]).headline()
        lines.append(f"  elastic            fit speedup {headline}; its breakdown is the table logged at fit end")
    else:
        lines.append("  measured speedup   n/a: no training step ran after a selection (run longer)")
    lines.append(
        f"  energy (estimate)  {summary['energy_wh_estimate']:.2f} Wh = {wall:.0f} s x {summary['power_watts']:g} W "
        f"(device.power_watts: an estimate, not a measurement)"
    )
    board = summary["tensorboard_dir"]
    board_line = f"tensorboard --logdir {board}" if board else "none (no logger, or fast_dev_run)"
    lines.append(f"  TensorBoard        {board_line}")
    files = ", ".join(summary.get("run_files", ["config", "log", "summary.json"]))
    lines.append(f"  run folder         {summary['output_dir']} ({files})")
    return "\n".join(lines)


def plain_json(value: Any) -> Any:
    """`value` with every non-finite number as None: JSON has no NaN (`"target_speedup": NaN` of a run without the
    callback made `summary.json` unreadable to strict parsers).

    Example:
        >>> plain_json({"a": math.nan, "b": [1.0, math.inf], "c": "x"})
        {'a': None, 'b': [1.0, None], 'c': 'x'}
    """
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {key: plain_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_json(item) for item in value]
    return value


def _choice(group: str) -> str:
    """The option picked for a config group, e.g. "efficientnet_lite0" for `model`."""
    return str(HydraConfig.get().runtime.choices.get(group, "?"))


if __name__ == "__main__":
    main()
