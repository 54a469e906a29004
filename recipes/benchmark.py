"""Compare elastic tensor selection with full fine-tuning and the usual baselines, side by side, in one command.

    python recipes/benchmark.py                          # Lite0 x ELPV at 96 px, 3 seeds (docs/results.md)
    python recipes/benchmark.py benchmark=quick          # one seed, 4 epochs: 11.4 minutes on 2 CPU cores
    python recipes/benchmark.py benchmark=fashion_mnist  # Lite0 x Fashion-MNIST
    python recipes/benchmark.py benchmark.seeds=[0] benchmark.baselines=[full] benchmark.elastic_speedups=[2.0]

Composes `conf/benchmark.yaml`, checks the whole config up front, then for every seed runs every method one after
another, each in a fresh process (so that peak memory and state are its own), on the same data split and epochs:
full fine-tuning, head only, BitFit-like (head, biases, norm layers), a static selection of the last k tensors
chosen offline to fit the same per-step budget, Lightning's `BackboneFinetuning`, and `ElasticTensorSelection` at
each target speedup. Each run measures its fit's wall clock (for elastic: profiling, probes and selections
included), every step's time, validation accuracy after every epoch against wall-clock time, test accuracy, peak
memory and energy (NVML on NVIDIA GPUs; elsewhere wall time x `device.power_watts`, an estimate).

Writes to the run folder: `results.csv` (one row per method and seed), `results.md` (mean and spread over seeds,
the elastic runs' own figures, the targets of the benchmark issue met or missed), `runs.json` (everything measured,
curves and selections included), `accuracy_vs_time.png`, `selection_heatmap.png`; and logs every run, plus the
table and plots, to TensorBoard (`tensorboard --logdir <run folder>/tensorboard`).
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import multiprocessing
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
import torch.nn.functional as F
from _common import ConfigError, build, exit_on_config_error, set_threads
from lightning.pytorch.callbacks import BackboneFinetuning
from omegaconf import DictConfig, OmegaConf

import lightning_elastic.callback as elastic_callback
from lightning_elastic import ElasticTensorSelection, TimingProfile, profile
from lightning_elastic.freezing import match_patterns
from lightning_elastic.inspection import selection_heatmap
from lightning_elastic.zoo.baselines import TrainOnly, attach_backbone, bitfit, head_only, last_k_within_budget
from lightning_elastic.zoo.meters import (
    EnergyMeter,
    RunRecorder,
    nvml_energy_reader,
    peak_memory_mb,
    reset_peak_memory,
)

BASELINES: tuple[str, ...] = ("full", "head_only", "bitfit", "static_last_k", "backbone_finetuning")
# Baselines that train one fixed set of tensors: the elastic selection must beat them at the same budget.
STATIC: tuple[str, ...] = ("head_only", "bitfit", "static_last_k")
# The targets of the benchmark issue, for the reference elastic run against full fine-tuning.
TARGET_WALL_SPEEDUP = 1.8
TARGET_ACCURACY_POINTS = 1.0
TARGET_STEP_FRACTION = 0.55


@dataclass(frozen=True)
class Method:
    """One way of fine-tuning: a baseline, or the elastic selection at a target speedup."""

    name: str
    kind: str
    speedup: float = math.nan


def methods_of(cfg: DictConfig) -> list[Method]:
    """The methods `cfg.benchmark` asks for, baselines first.

    Example:
        >>> methods_of(OmegaConf.create({"benchmark": {"baselines": ["full"], "elastic_speedups": [2]}}))
        [Method(name='full', kind='full', speedup=nan), Method(name='elastic_2x', kind='elastic', speedup=2.0)]
    """
    bench = cfg.benchmark
    methods = [Method(str(b), str(b)) for b in bench.baselines]
    methods += [Method(f"elastic_{float(s):g}x", "elastic", float(s)) for s in bench.elastic_speedups]
    return methods


def benchmark_problems(cfg: DictConfig) -> list[str]:
    """What is wrong with `cfg.benchmark`, one message per problem.

    Example:
        >>> benchmark_problems(OmegaConf.create({"benchmark": {"seeds": [], "baselines": ["full"],
        ...     "elastic_speedups": [2.0], "static_speedup": 2.0, "backbone_unfreeze_epoch": 1,
        ...     "reference_speedup": 2.0, "accuracy_fraction": 0.99, "monitor": "val/acc"}}))
        ['benchmark: `seeds` must be a non-empty list of distinct ints. Found: []']
    """
    bench = cfg.benchmark
    problems = []
    seeds = list(bench.seeds)
    if not seeds or not all(_is_int(s) for s in seeds) or len(set(seeds)) != len(seeds):
        problems.append(f"`seeds` must be a non-empty list of distinct ints. Found: {seeds}")
    unknown = [b for b in bench.baselines if b not in BASELINES]
    if unknown or len(set(bench.baselines)) != len(bench.baselines):
        problems.append(f"`baselines` must be distinct names among {BASELINES}. Found: {list(bench.baselines)}")
    speedups = list(bench.elastic_speedups)
    if not all(_is_number(s) and s > 1 for s in speedups) or len(set(speedups)) != len(speedups):
        problems.append(f"`elastic_speedups` must be distinct numbers > 1. Found: {speedups}")
    if not bench.baselines and not speedups:
        problems.append("`baselines` and `elastic_speedups` must name at least one method. Found: none")
    for key in ("static_speedup", "reference_speedup"):
        if not (_is_number(bench[key]) and bench[key] > 1):
            problems.append(f"`{key}` must be a number > 1. Found: {bench[key]!r}")
    if not (_is_int(bench.backbone_unfreeze_epoch) and bench.backbone_unfreeze_epoch >= 0):
        problems.append(f"`backbone_unfreeze_epoch` must be an int >= 0. Found: {bench.backbone_unfreeze_epoch!r}")
    if not (_is_number(bench.accuracy_fraction) and 0 < bench.accuracy_fraction <= 1):
        problems.append(f"`accuracy_fraction` must be a number in (0, 1]. Found: {bench.accuracy_fraction!r}")
    return [f"benchmark: {p}" for p in problems]


def run_config(cfg: DictConfig, method: Method, seed: int) -> dict[str, Any]:
    """The resolved config of one run: `cfg` with the seed, the method's callback and its own TensorBoard folder.

    Resolved here, in the process that has Hydra's runtime settings, so the run can be handed to a fresh process.
    """
    run = OmegaConf.to_container(cfg, resolve=False)
    assert isinstance(run, dict)
    run_cfg = OmegaConf.create(run)
    run_cfg.seed = seed
    if method.kind == "elastic":
        run_cfg.elastic.speedup = method.speedup
    else:
        run_cfg.elastic._target_ = None  # no callback; its settings stay for the static selection's time model
    if run_cfg.logger.get("_target_") is not None:
        run_cfg.logger.name = method.name
        run_cfg.logger.version = f"seed_{seed}"
    # `${hydra:...}` only resolves while Hydra runs: fix the output folder before resolving.
    run_cfg.paths.output_dir = str(cfg.paths.output_dir)
    resolved = OmegaConf.to_container(run_cfg, resolve=True)
    assert isinstance(resolved, dict)
    return {str(key): value for key, value in resolved.items()}


# ---------------------------------------------------------------------- the command line


@hydra.main(config_path="../conf", config_name="benchmark", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """The command line: a config problem ends the run with its message (exit status 2), not a stack trace."""
    try:
        exit_on_config_error(run, cfg)
    except RunFailed as err:
        print(err, file=sys.stderr)
        raise SystemExit(1) from None


class RunFailed(RuntimeError):
    """Some runs ended with an error (each one's process printed its traceback; results.md lists them)."""


def run(cfg: DictConfig) -> list[dict[str, Any]]:
    """Check the config, run every method for every seed in its own process, write the results; return the runs."""
    problems = benchmark_problems(cfg)
    methods = methods_of(cfg) if not problems else []
    if not problems:
        # The last method is an elastic one whenever any is asked for: building it checks the callback's settings.
        try:
            build(OmegaConf.create(run_config(cfg, methods[-1], int(cfg.benchmark.seeds[0]))))
        except ConfigError as err:
            problems += err.problems
    if problems:
        raise ConfigError(problems)
    output_dir = Path(cfg.paths.output_dir)
    (output_dir / "runs").mkdir(parents=True, exist_ok=True)
    runs = []
    started = time.perf_counter()
    for seed in cfg.benchmark.seeds:
        for method in methods:
            path = output_dir / "runs" / f"{method.name}_seed_{seed}.json"
            result = run_isolated(run_config(cfg, method, int(seed)), method, path)
            runs.append(result)
            outcome = (
                f"FAILED: {result['error']}"
                if "error" in result
                else f"fit {result['wall_seconds']:.1f} s, final {cfg.benchmark.monitor} {result['final_accuracy']:.4f}"
            )
            print(
                f"[benchmark] {method.name} seed {seed}: {outcome}, "
                f"{time.perf_counter() - started:.0f} s since the benchmark started",
                flush=True,
            )
    (output_dir / "runs.json").write_text(json.dumps(runs, indent=1) + "\n")
    done = [r for r in runs if "error" not in r]
    failed = [r for r in runs if "error" in r]
    fraction = float(cfg.benchmark.accuracy_fraction)
    report = f"# Benchmark\n\nEvery run failed: nothing to compare.\n{failures(failed)}"
    if done:
        rows = table_rows(done, fraction)
        write_csv(rows, output_dir / "results.csv")
        plot_accuracy(done, fraction, output_dir / "accuracy_vs_time.png")
        plot_selections(done, output_dir / "selection_heatmap.png")
        report = markdown_report(cfg, rows, time.perf_counter() - started) + failures(failed)
        log_tensorboard(done, report, fraction, output_dir)
    (output_dir / "results.md").write_text(report)
    print(report)
    if failed:
        raise RunFailed(f"{len(failed)} of {len(runs)} runs failed; results.md lists them")
    return runs


def run_isolated(config: dict[str, Any], method: Method, path: Path) -> dict[str, Any]:
    """Run one method in a fresh process (spawned: no state, threads or memory shared with this one).

    A run that fails gives a record with its `error` instead of figures, so the other methods still run.
    """
    context = multiprocessing.get_context("spawn")
    process = context.Process(target=run_method, args=(config, method, str(path)))
    process.start()
    process.join()
    result: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    if process.exitcode != 0 and "error" not in result:
        result = {"error": f"the process ended with exit code {process.exitcode}"}
    if "error" in result:
        result.update(method=method.name, kind=method.kind, speedup=method.speedup, seed=int(config["seed"]))
    return result


# ---------------------------------------------------------------------- one run, in its own process


def run_method(config: dict[str, Any], method: Method, path: str) -> None:
    """Fit one method under measurement, test it, and write everything measured to `path` as JSON.

    On an error, `path` holds the error's message and the process ends with the traceback.
    """
    try:
        measure(OmegaConf.create(config), method, path)
    except Exception as err:
        Path(path).write_text(json.dumps({"error": f"{type(err).__name__}: {err}"}) + "\n")
        raise


def measure(cfg: DictConfig, method: Method, path: str) -> None:
    """Fit one method under measurement, test it, and write everything measured to `path` as JSON."""
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    set_threads(cfg)
    parts = build(cfg)
    module, trainer, datamodule = parts.module, parts.trainer, parts.datamodule
    datamodule.setup("fit")  # data loading is the same for every method: not part of the measured fit
    head = [str(cfg.model.head)]
    total = len(list(module.parameters()))
    result: dict[str, Any] = {"method": method.name, "kind": method.kind, "speedup": method.speedup}
    result.update(seed=int(cfg.seed), offline_seconds=0.0, trained_tensors=float(total), total_tensors=total)
    extra: list[L.Callback] = []
    if method.kind in ("head_only", "bitfit"):
        names = head_only(module, head) if method.kind == "head_only" else bitfit(module, head)
        extra.append(TrainOnly(names))
        result["trained_tensors"] = float(len(names))
    elif method.kind == "static_last_k":
        started = time.perf_counter()
        given = cfg.elastic.get("profile")  # a saved profile given to the elastic runs is the static one's too
        timing = (
            TimingProfile.from_dict(json.loads(Path(given).read_text()))
            if given
            else offline_profile(module, datamodule, cfg)
        )
        names = last_k_within_budget(timing, float(cfg.benchmark.static_speedup), head)
        result["offline_seconds"] = time.perf_counter() - started
        result["trained_tensors"] = float(len(names))
        extra.append(TrainOnly(names))
    elif method.kind == "backbone_finetuning":
        attach_backbone(module, head)
        extra.append(BackboneFinetuning(unfreeze_backbone_at_epoch=int(cfg.benchmark.backbone_unfreeze_epoch)))
        result["trained_tensors"] = math.nan  # a schedule: the head (and norm layers) first, then everything
    recorder = RunRecorder(str(cfg.benchmark.monitor))
    # The trainer was built with the config's callbacks; the method's own join them before fitting starts.
    trainer.callbacks.extend([*extra, recorder])  # type: ignore[attr-defined]

    before = {name: p.detach().cpu().clone() for name, p in module.named_parameters()}
    device = trainer.strategy.root_device
    meter = EnergyMeter(float(cfg.device.power_watts), reader=nvml_energy_reader(device))
    reset_peak_memory(device)
    with timed_freezing() as freezing:
        cpu = _cpu_seconds()
        started = time.perf_counter()
        meter.start()
        trainer.fit(module, datamodule=datamodule)
        wall = time.perf_counter() - started
        joules, source = meter.stop()
        cpu = _cpu_seconds() - cpu
    peak = peak_memory_mb(device)
    tested = trainer.test(module, datamodule=datamodule, verbose=False)

    record = recorder.record
    updated = [name for name, p in module.named_parameters() if not torch.equal(p.detach().cpu(), before[name])]
    accuracies = [p.value for p in record.curve]
    result.update(
        wall_seconds=wall,
        validation_seconds=record.validation_seconds,
        steps=len(record.step_seconds),
        mean_step_seconds=_mean(record.step_seconds),
        curve=[asdict(p) for p in record.curve],
        best_accuracy=max(accuracies, default=math.nan),
        final_accuracy=accuracies[-1] if accuracies else math.nan,
        test_accuracy=float(tested[0].get("test/acc", math.nan)) if tested else math.nan,
        peak_memory_mb=peak,
        energy_joules=joules,
        energy_source=source,
        updated_tensors=updated,
        cpu_share=cpu / (wall * torch.get_num_threads()),
    )
    for callback in parts.callbacks:
        if isinstance(callback, ElasticTensorSelection):
            result.update(elastic_figures(callback, head, freezing["seconds"]))
            result["trained_tensors"] = _mean([h["mask"].count("1") for h in result["history"]])
    Path(path).write_text(json.dumps(result, indent=1) + "\n")


def offline_profile(module: L.LightningModule, datamodule: Any, cfg: DictConfig) -> TimingProfile:
    """The timing profile the static selection is chosen from, taken before training on the first training images.

    Taken as the elastic callback takes its own: on the training device, on one batch of the training set read
    without advancing any random state (so training then sees the same batches as every other method).
    """
    accelerator = str(cfg.device.accelerator)
    device = torch.device("cuda" if accelerator in ("cuda", "gpu") else "cpu")
    module.to(device)
    loader = datamodule.train_dataloader()
    with torch.random.fork_rng(devices=[]):
        size = min(int(loader.batch_size), len(loader.dataset))
        images, labels = loader.collate_fn([loader.dataset[i] for i in range(size)])
    images, labels = images.to(device), labels.to(device)
    return profile(
        module,
        lambda: F.cross_entropy(module(images), labels),
        method="flops" if cfg.elastic.time_model == "flops" else "measured",
        cache_dir=None,
    )


@contextmanager
def timed_freezing() -> Iterator[dict[str, float]]:
    """Seconds the elastic callback spends switching tensors on and off (`requires_grad` and BatchNorm modes).

    The callback's own summary times the selection (importance and the dynamic program) but not the switch that
    follows it; this wraps the two functions it calls for the switch for the length of the run.
    """
    totals = {"seconds": 0.0}
    originals = {name: getattr(elastic_callback, name) for name in ("apply_mask", "apply_bn_policy")}

    def timed(function: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                totals["seconds"] += time.perf_counter() - started

        return wrapper

    for name, function in originals.items():
        setattr(elastic_callback, name, timed(function))
    try:
        yield totals
    finally:
        for name, function in originals.items():
            setattr(elastic_callback, name, function)


def elastic_figures(callback: ElasticTensorSelection, head: Sequence[str], freeze_seconds: float) -> dict[str, Any]:
    """The elastic run's own figures: its summary, every selection's mask, and how much consecutive ones differ."""
    summary = callback.summary()
    history = callback._history
    assert callback._profile is not None
    names = list(callback._profile.names)
    masks = [h["mask"] for h in history]
    changes = [sum(a != b for a, b in zip(x, y, strict=True)) for x, y in itertools.pairwise(masks)]
    return {
        "elastic": summary,
        "freeze_seconds": freeze_seconds,
        "tensor_names": names,
        "required": [bool(r) for r in match_patterns(names, head, "train_always")],
        "history": [
            {k: h[k] for k in ("epoch", "step", "mask", "predicted_seconds", "budget_seconds", "full_seconds")}
            for h in history
        ],
        "mask_changes": changes,
    }


# ---------------------------------------------------------------------- tables


def time_to_accuracy(curve: Sequence[dict[str, float]], target: float) -> float:
    """Seconds into the fit at the first validation reaching `target`; NaN if none does.

    Example:
        >>> time_to_accuracy([{"seconds": 10.0, "value": 0.5}, {"seconds": 20.0, "value": 0.8}], 0.7)
        20.0
    """
    return next((p["seconds"] for p in curve if p["value"] >= target), math.nan)


def table_rows(runs: Sequence[dict[str, Any]], fraction: float) -> list[dict[str, Any]]:
    """One flat row per run, with the figures that compare it with the full fine-tuning run of the same seed."""
    full = {r["seed"]: r for r in runs if r["kind"] == "full"}
    rows = []
    for r in runs:
        reference = full.get(r["seed"])
        elastic = r.get("elastic", {})
        rows.append(
            {
                "method": r["method"],
                "seed": r["seed"],
                "wall_s": r["wall_seconds"],
                "speedup_vs_full": reference["wall_seconds"] / r["wall_seconds"] if reference else math.nan,
                "train_s": r["wall_seconds"] - r["validation_seconds"],
                "validation_s": r["validation_seconds"],
                "steps": r["steps"],
                "mean_step_ms": r["mean_step_seconds"] * 1e3,
                "best_acc": r["best_accuracy"],
                "final_acc": r["final_accuracy"],
                "test_acc": r["test_accuracy"],
                "time_to_target_s": (
                    time_to_accuracy(r["curve"], fraction * reference["best_accuracy"]) if reference else math.nan
                ),
                "peak_memory_mb": r["peak_memory_mb"],
                "energy_wh": r["energy_joules"] / 3600.0,
                "energy_source": r["energy_source"],
                "cpu_share": r["cpu_share"],
                "trained_tensors": r["trained_tensors"],
                "total_tensors": r["total_tensors"],
                "offline_s": r["offline_seconds"],
                "profile_s": elastic.get("profile_seconds", math.nan),
                "probe_s": elastic.get("probe_seconds", math.nan),
                "select_s": elastic.get("select_seconds", math.nan),
                "freeze_s": r.get("freeze_seconds", math.nan),
                "full_step_ms": elastic.get("full_step_seconds", math.nan) * 1e3,
                "selected_step_ms": elastic.get("selected_step_seconds", math.nan) * 1e3,
                "step_fraction": 1.0 / elastic.get("measured_speedup", math.nan),
                "step_vs_full_run": (
                    elastic.get("selected_step_seconds", math.nan) / reference["mean_step_seconds"]
                    if reference
                    else math.nan
                ),
                "predicted_step_ms": _mean([h["predicted_seconds"] for h in r.get("history", [])]) * 1e3,
                "selections": elastic.get("selections", math.nan),
                "changed_selections": sum(c > 0 for c in r["mask_changes"]) if "mask_changes" in r else math.nan,
                "mean_tensors_changed": _mean(r["mask_changes"]) if r.get("mask_changes") else math.nan,
            }
        )
    return rows


def write_csv(rows: Sequence[dict[str, Any]], path: Path) -> None:
    with path.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def mean_spread(values: Sequence[float]) -> tuple[float, float, int]:
    """Mean and sample standard deviation of the finite values, and how many there are (spread NaN below 2).

    Example:
        >>> mean_spread([1.0, 3.0, math.nan])
        (2.0, 1.4142135623730951, 2)
    """
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return math.nan, math.nan, 0
    return statistics.fmean(finite), statistics.stdev(finite) if len(finite) > 1 else math.nan, len(finite)


def cell(values: Sequence[float], scale: float = 1.0, digits: int = 1) -> str:
    """`mean ± spread` of `values` x `scale`; the count of finite values when some are missing; "n/a" for none.

    Example:
        >>> cell([0.81, 0.83], scale=100), cell([2.0, math.nan]), cell([math.nan])
        ('82.0 ± 1.4', '2.0 (1/2)', 'n/a')
    """
    mean, spread, count = mean_spread(values)
    if count == 0:
        return "n/a"
    text = f"{mean * scale:.{digits}f}"
    if math.isfinite(spread):
        text += f" ± {spread * scale:.{digits}f}"
    if count < len(values):
        text += f" ({count}/{len(values)})"
    return text


def _by_method(rows: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    grouped: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        grouped.setdefault(row["method"], []).append(row)
    return grouped


def markdown_report(cfg: DictConfig, rows: Sequence[dict[str, Any]], seconds: float) -> str:
    """The results as markdown: the comparison table, the elastic runs' own figures, and the targets."""
    bench = cfg.benchmark
    grouped = _by_method(rows)
    seeds = list(bench.seeds)
    fraction = float(bench.accuracy_fraction)
    sources = sorted({r["energy_source"] for r in rows})
    energy_note = (
        f"estimated as wall time x {cfg.device.power_watts:g} W (`device.power_watts`): proportional to wall time"
        if sources == ["estimate"]
        else "measured with NVML"
    )
    lines = [
        f"# Benchmark: {_choice(cfg, 'model')} x {_choice(cfg, 'dataset')} at {cfg.dataset.image_size} px",
        "",
        f"- {len(seeds)} seed(s) {seeds}, {cfg.trainer.max_epochs} epochs, batch {cfg.dataset.batch_size}, "
        f"{cfg.module.optimizer} lr {cfg.module.lr:g}; elastic: re-selection every {cfg.elastic.interval} "
        f"{cfg.elastic.interval_unit}(s) after {cfg.elastic.probe_steps} probe steps; device {_choice(cfg, 'device')} "
        f"({torch.get_num_threads()} threads)",
        f"- benchmark wall time {seconds / 60:.1f} min; figures are mean ± sample standard deviation over seeds",
        "- wall: the whole fit (training, every validation; for elastic also profiling, probes, selections); "
        "step: mean of every training step; accuracy: validation (`" + str(bench.monitor) + "`), best and final "
        "epoch; test: the final model on the test split",
        f"- time to target: first validation reaching {fraction:.0%} of full fine-tuning's best (same seed); "
        f"energy: {energy_note}",
        f"- contention check: each run's CPU time over wall time x {torch.get_num_threads()} threads was "
        f"{min(r['cpu_share'] for r in rows):.0%} to {max(r['cpu_share'] for r in rows):.0%} (well below 100%: "
        "the run waited for the CPU, or for data loading and Python)",
        "",
        "| method | tensors trained | wall (s) | speedup vs full | step (ms) | best acc (%) | final acc (%) | "
        f"test acc (%) | time to {fraction:.0%} of full (s) | peak memory (MiB) | energy (Wh) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, group in grouped.items():

        def col(key: str, group: list[dict[str, Any]] = group) -> list[float]:
            return [float(r[key]) for r in group]

        shares = [t / n for t, n in zip(col("trained_tensors"), col("total_tensors"), strict=True)]
        tensors = f"{cell(shares, 100, 0)}%" if any(math.isfinite(s) for s in shares) else "schedule"
        lines.append(
            f"| {name} | {tensors} | {cell(col('wall_s'))} | {cell(col('speedup_vs_full'), digits=2)} "
            f"| {cell(col('mean_step_ms'), digits=0)} | {cell(col('best_acc'), 100)} "
            f"| {cell(col('final_acc'), 100)} | {cell(col('test_acc'), 100)} | {cell(col('time_to_target_s'))} "
            f"| {cell(col('peak_memory_mb'), digits=0)} | {cell(col('energy_wh'), digits=3)} |"
        )
    elastic = {name: group for name, group in grouped.items() if math.isfinite(group[0]["selections"])}
    if elastic:
        lines += [
            "",
            "## The elastic runs' own figures",
            "",
            "Per-step figures from the callback's `summary()`: the full step is the mean probe step (every tensor "
            "trained) and the selected step the mean of every other step, both measured in the same run; "
            "predicted: the time model's figure for the selections made; selected / full run: the selected step "
            "against the mean step of the full fine-tuning run of the same seed. Overheads are seconds per run: "
            "profiling (once, before the first step), probe steps (real training steps with every tensor trained), "
            "selection (importance reduction and the dynamic program), freezing (switching `requires_grad` and "
            "BatchNorm modes). Changed: re-selections whose mask differs from the one before.",
            "",
            "| method | full step (ms) | selected step (ms) | predicted (ms) | selected / full | selected / full run "
            "| profile (s) | probe steps (s) | selection (s) | freezing (s) | selections | changed "
            "| tensors changed per re-selection |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name, group in elastic.items():

            def ecol(key: str, group: list[dict[str, Any]] = group) -> list[float]:
                return [float(r[key]) for r in group]

            lines.append(
                f"| {name} | {cell(ecol('full_step_ms'), digits=0)} | {cell(ecol('selected_step_ms'), digits=0)} "
                f"| {cell(ecol('predicted_step_ms'), digits=0)} | {cell(ecol('step_fraction'), digits=3)} "
                f"| {cell(ecol('step_vs_full_run'), digits=3)} | {cell(ecol('profile_s'))} | {cell(ecol('probe_s'))} "
                f"| {cell(ecol('select_s'), digits=3)} | {cell(ecol('freeze_s'), digits=3)} "
                f"| {cell(ecol('selections'), digits=0)} | {cell(ecol('changed_selections'))} "
                f"| {cell(ecol('mean_tensors_changed'))} |"
            )
    lines += ["", *targets(cfg, grouped), ""]
    return "\n".join(lines)


def targets(cfg: DictConfig, grouped: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The benchmark issue's targets for the reference elastic run, each met or missed, with the measured figure."""
    reference = f"elastic_{float(cfg.benchmark.reference_speedup):g}x"
    if reference not in grouped or "full" not in grouped:
        return [f"Targets: not checked (they need the `full` and `{reference}` runs)."]
    ours, full = grouped[reference], grouped["full"]

    def mean(group: list[dict[str, Any]], key: str) -> float:
        return mean_spread([float(r[key]) for r in group])[0]

    def verdict(met: bool) -> str:
        return "met" if met else "**missed**"

    wall = mean(ours, "speedup_vs_full")
    step = mean(ours, "step_fraction")
    accuracy, full_accuracy = mean(ours, "final_acc"), mean(full, "final_acc")
    lines = [
        f"## Targets ({reference} against the others, mean over seeds)",
        "",
        f"- end-to-end wall clock >= {TARGET_WALL_SPEEDUP}x faster than full fine-tuning: {wall:.2f}x, "
        f"{verdict(wall >= TARGET_WALL_SPEEDUP)}",
        f"- selected step <= {TARGET_STEP_FRACTION} of the full step measured in the same run: {step:.3f}, "
        f"{verdict(step <= TARGET_STEP_FRACTION)} (against the full fine-tuning run's mean step: "
        f"{mean(ours, 'step_vs_full_run'):.3f})",
        f"- final accuracy within {TARGET_ACCURACY_POINTS:g} point of full fine-tuning: {accuracy * 100:.1f}% vs "
        f"{full_accuracy * 100:.1f}% ({(accuracy - full_accuracy) * 100:+.1f}), "
        f"{verdict(accuracy >= full_accuracy - TARGET_ACCURACY_POINTS / 100)}",
    ]
    for name in STATIC:
        if name in grouped:
            other = mean(grouped[name], "final_acc")
            lines.append(
                f"- final accuracy above {name} (step {mean(grouped[name], 'mean_step_ms'):.0f} ms vs "
                f"{mean(ours, 'mean_step_ms'):.0f} ms): {accuracy * 100:.1f}% vs {other * 100:.1f}%, "
                f"{verdict(accuracy > other)}"
            )
    return lines


def failures(failed: Sequence[dict[str, Any]]) -> str:
    """A markdown section listing the runs that failed and why; empty when none did."""
    if not failed:
        return ""
    lines = ["", "## Failed runs", "", *(f"- {r['method']}, seed {r['seed']}: {r['error']}" for r in failed), ""]
    return "\n".join(lines)


def _choice(cfg: DictConfig, group: str) -> str:
    """The option picked for a config group, or what its `_target_` builds when Hydra is not running."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return str(HydraConfig.get().runtime.choices.get(group, "?"))
    node = cfg.get(group)
    target = node.get("_target_") if node is not None else None
    return str(target).rsplit(".", 1)[-1] if target else "?"


# ---------------------------------------------------------------------- plots and TensorBoard


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on the machines that run benchmarks
    import matplotlib.pyplot as plt

    return plt


def accuracy_figure(runs: Sequence[dict[str, Any]], fraction: float) -> Any:
    """Validation accuracy against seconds into the fit for every method: mean over seeds at each epoch."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(8, 5))
    by_method: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        by_method.setdefault(r["method"], []).append(r)
    for name, group in by_method.items():
        epochs = min(len(r["curve"]) for r in group)
        seconds = [statistics.fmean(r["curve"][e]["seconds"] for r in group) for e in range(epochs)]
        values = [[100 * r["curve"][e]["value"] for r in group] for e in range(epochs)]
        spread = [statistics.stdev(v) if len(v) > 1 else 0.0 for v in values]
        style = "-" if name.startswith("elastic") else "--" if name == "full" else ":"
        axes.errorbar(
            seconds,
            [statistics.fmean(v) for v in values],
            yerr=spread,
            fmt=style,
            marker="o",
            markersize=3,
            capsize=2,
            label=name,
        )
    full_best = [r["best_accuracy"] for r in runs if r["kind"] == "full"]
    if full_best:
        axes.axhline(
            100 * fraction * statistics.fmean(full_best),
            color="grey",
            linewidth=0.8,
            label=f"{fraction:.0%} of full's best",
        )
    axes.set_xlabel("wall-clock seconds into the fit (profiling, probes and validations included)")
    axes.set_ylabel("validation accuracy (%)")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    return figure


def plot_accuracy(runs: Sequence[dict[str, Any]], fraction: float, path: Path) -> None:
    figure = accuracy_figure(runs, fraction)
    figure.savefig(path, dpi=120)
    _pyplot().close(figure)


def selections_figure(runs: Sequence[dict[str, Any]]) -> Any | None:
    """Which tensors each elastic run of the first seed trained at each selection; None without elastic runs."""
    first_seed = runs[0]["seed"] if runs else None
    elastic = [r for r in runs if r.get("history") and r["seed"] == first_seed]
    if not elastic:
        return None
    plt = _pyplot()
    figure, axes = plt.subplots(1, len(elastic), figsize=(2.2 + 1.6 * len(elastic), 6), squeeze=False)
    for axis, r in zip(axes[0], elastic, strict=True):
        masks = [[c == "1" for c in h["mask"]] for h in r["history"]]
        image = selection_heatmap(masks, r["required"], [False] * len(r["required"]), cell=1)
        axis.imshow(image, aspect="auto", interpolation="nearest")
        axis.set_xticks(range(len(masks)), [str(h["epoch"]) for h in r["history"]], fontsize=7)
        axis.set_xlabel("epoch of selection")
        share = statistics.fmean(m.count(True) / len(m) for m in masks)
        axis.set_title(f"{r['method']}\n{share:.0%} trained", fontsize=9)
    axes[0][0].set_ylabel("tensor (forward order: input at the top)")
    figure.suptitle(f"Selections, seed {first_seed} (green trained, blue pinned head, black frozen)", fontsize=9)
    figure.tight_layout()
    return figure


def plot_selections(runs: Sequence[dict[str, Any]], path: Path) -> None:
    figure = selections_figure(runs)
    if figure is not None:
        figure.savefig(path, dpi=120)
        _pyplot().close(figure)


def log_tensorboard(runs: Sequence[dict[str, Any]], report: str, fraction: float, output_dir: Path) -> None:
    """The table, the plots and every run's accuracy against whole seconds into its fit, under `summary/`."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(output_dir / "tensorboard" / "summary"))
    try:
        writer.add_text("benchmark/results", report)
        writer.add_figure("benchmark/accuracy_vs_time", accuracy_figure(runs, fraction))
        figure = selections_figure(runs)
        if figure is not None:
            writer.add_figure("benchmark/selections", figure)
        for r in runs:
            for point in r["curve"]:
                tag = f"accuracy_vs_seconds/{r['method']}/seed_{r['seed']}"
                writer.add_scalar(tag, point["value"], round(point["seconds"]))
    finally:
        writer.close()


# ---------------------------------------------------------------------- helpers


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else math.nan


def _cpu_seconds() -> float:
    """CPU seconds this process has used so far, every thread included."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


if __name__ == "__main__":
    main()
