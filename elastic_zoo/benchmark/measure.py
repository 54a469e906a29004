"""One run of one method, in a fresh process: fit under measurement, test, and write every figure as JSON."""

from __future__ import annotations

import ctypes
import itertools
import json
import math
import multiprocessing
import os
import resource
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from PIL import Image

from elastic_zoo.benchmark.cells import mean_or_nan
from elastic_zoo.benchmark.methods import Method
from elastic_zoo.benchmark.readout import METRICS
from elastic_zoo.meters import EnergyMeter, RunRecorder, nvml_energy_reader, peak_memory_mb, reset_peak_memory
from elastic_zoo.recipe import build, quiet_console, seed_everything, set_threads
from lightning_elastic import ElasticTensorSelection, SpeedupOutOfReach
from lightning_elastic.freezing import match_patterns, tied_names


def run_isolated(config: dict[str, Any], method: Method, path: Path) -> dict[str, Any]:
    """Run one method in a fresh process (spawned: no state, threads or memory shared with this one).

    A run that fails gives a record with its `error` instead of figures, so the other methods still run.
    """
    context = multiprocessing.get_context("spawn")
    process = context.Process(target=run_method, args=(config, method, str(path), os.getpid()))
    process.start()
    try:
        process.join()
    except BaseException:  # the benchmark is stopping: the run under way ends with it, before the report is written
        process.terminate()
        process.join(timeout=30)
        if process.is_alive():  # it did not end on SIGTERM
            process.kill()
            process.join()
        raise
    result: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    if process.exitcode != 0 and "error" not in result:
        result = {"error": f"the process ended with exit code {process.exitcode}"}
    if "error" in result:
        result.update(method=method.name, kind=method.kind, speedup=method.speedup, seed=int(config["seed"]))
    return result


def run_method(config: dict[str, Any], method: Method, path: str, parent: int) -> None:
    """Fit one method under measurement, test it, and write everything measured to `path` as JSON.

    On an error, `path` holds the error's message and the process ends with the traceback. The run ends with the
    benchmark process `parent` that started it (`die_with_parent`).
    """
    die_with_parent(parent)
    try:
        measure(OmegaConf.create(config), method, path)
    except Exception as err:
        record: dict[str, Any] = {"error": f"{type(err).__name__}: {err}"}
        if isinstance(err, SpeedupOutOfReach):  # the callback's answer, before training: not a failure of the run
            record["refused_at_most"] = err.reachable
        Path(path).write_text(json.dumps(record) + "\n")
        raise


def die_with_parent(parent: int) -> None:
    """On Linux, end this process (SIGTERM) when the process `parent` that started it ends, however it ends.

    A benchmark stopped by a signal ends its own process only, and with it the lock that keeps timed runs apart
    (`flock`): the run it had started went on fitting beside whatever took the lock next, and spoilt both timings.
    Elsewhere nothing changes (stop such a benchmark by its process group).
    """
    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != parent:  # the parent ended before the request was made: nobody would send the signal
        os.kill(os.getpid(), signal.SIGTERM)


def measure(cfg: DictConfig, method: Method, path: str) -> None:
    """Fit one method under measurement, test it, and write everything measured to `path` as JSON."""
    quiet_console()  # a spawned process: the benchmark's own filters are not inherited
    seed_everything(cfg, workers=True)
    set_threads(cfg)
    parts = build(cfg)
    module, trainer, datamodule = parts.module, parts.trainer, parts.datamodule
    datamodule.setup("fit")  # data loading is the same for every method: not part of the measured fit
    head = [str(cfg.model.head)]
    total = len(list(module.parameters()))
    result: dict[str, Any] = {"method": method.name, "kind": method.kind, "speedup": method.speedup}
    setup = parts.prepare_method()  # static_last_k's offline choice happens here, before the measured fit
    # a schedule's trained set changes during the fit (NaN); the elastic run's is its selections' mean, below
    result.update(seed=int(cfg.seed), offline_seconds=setup.offline_seconds, total_tensors=total)
    result["trained_tensors"] = setup.trained_tensors
    recorder = RunRecorder([f"val/{metric}" for metric in METRICS])  # every metric: any read-out can be made
    trainer.callbacks.append(recorder)  # type: ignore[attr-defined]

    before = {name: p.detach().cpu().clone() for name, p in module.named_parameters()}
    device = trainer.strategy.root_device
    meter = EnergyMeter(float(cfg.device.power_watts), reader=nvml_energy_reader(device))
    reset_peak_memory(device)
    cpu = _cpu_seconds()
    started = time.perf_counter()
    meter.start()
    trainer.fit(module, datamodule=datamodule)
    wall = time.perf_counter() - started
    joules, source = meter.stop()
    cpu = _cpu_seconds() - cpu
    peak = peak_memory_mb(device)
    tested = trainer.test(module, datamodule=datamodule, verbose=False)
    val_images = evaluated_images(trainer.num_val_batches, datamodule.val_dataloader())
    test_images = evaluated_images(trainer.num_test_batches, datamodule.test_dataloader())

    record = recorder.record
    updated = [name for name, p in module.named_parameters() if not torch.equal(p.detach().cpu(), before[name])]
    result.update(
        wall_seconds=wall,
        validation_seconds=record.validation_seconds,
        steps=len(record.step_seconds),
        mean_step_seconds=mean_or_nan(record.step_seconds),
        step_seconds=record.step_seconds,  # every training batch, in order: where a fit's time went
        curve=[asdict(p) for p in record.curve],
        test={f"test/{m}": float(tested[0].get(f"test/{m}", math.nan)) if tested else math.nan for m in METRICS},
        val_images=val_images,
        test_images=test_images,
        peak_memory_mb=peak,
        energy_joules=joules,
        energy_source=source,
        updated_tensors=updated,
        cpu_share=cpu / (wall * torch.get_num_threads()),
    )
    for callback in parts.callbacks:
        if isinstance(callback, ElasticTensorSelection):
            map_path = Path(path).with_name(f"{Path(path).stem}_selection_map.png")
            result.update(elastic_figures(callback, head, map_path, tied_names(module)))
            result["trained_tensors"] = mean_or_nan([h["mask"].count("1") for h in result["history"]])
    Path(path).write_text(json.dumps(result, indent=1) + "\n")


def evaluated_images(batches: Sequence[int | float], loader: Any) -> int:
    """How many images an evaluation loop saw: its batches (after `limit_*_batches`) of the loader, the last partial.

    Example:
        >>> from torch.utils.data import DataLoader
        >>> evaluated_images([3], DataLoader(list(range(100)), batch_size=32)), evaluated_images([4], DataLoader(
        ...     list(range(100)), batch_size=32))
        (96, 100)
    """
    total = sum(int(b) for b in batches if math.isfinite(b))
    return min(len(loader.dataset), total * int(loader.batch_size))


def elastic_figures(
    callback: ElasticTensorSelection, head: Sequence[str], map_path: Path, aliases: Mapping[str, Sequence[str]]
) -> dict[str, Any]:
    """The elastic run's own figures: its summary, every selection's mask, and how much consecutive ones differ;
    `head` matched by a tensor's name or its `aliases` (`freezing.tied_names`), as the callback matches `train_always`.

    The callback's selection map is saved to `map_path` (a PNG; its path is in the figures), when there is one.
    """
    summary = callback.summary()
    history = callback.history
    assert callback.timing_profile is not None
    names = list(callback.timing_profile.names)
    masks = [h.mask for h in history]
    changes = [sum(a != b for a, b in zip(x, y, strict=True)) for x, y in itertools.pairwise(masks)]
    image = callback.selection_map()
    if image is not None:
        Image.fromarray(image).save(map_path)
    return {
        "elastic": summary,
        "freeze_seconds": summary["apply_seconds"],
        "tensor_names": names,
        "required": [bool(r) for r in match_patterns(names, head, "train_always", aliases)],
        "history": [h.to_dict() for h in history],
        "mask_changes": changes,
        "selection_map": str(map_path) if image is not None else None,
    }


def _cpu_seconds() -> float:
    """CPU seconds this process has used so far, every thread included."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
