"""Compare elastic tensor selection with full fine-tuning and the usual baselines, side by side, in one command.

    python recipes/benchmark.py                          # Lite0 x ELPV at 96 px, 5 paired seeds
    python recipes/benchmark.py benchmark=quick          # 3 paired seeds, 3 epochs, 4 methods: ~12 min (estimate)
    python recipes/benchmark.py benchmark=fashion_mnist  # Lite0 x Fashion-MNIST
    python recipes/benchmark.py benchmark.seeds=[0] benchmark.baselines=[full] benchmark.elastic_speedups=[2.0]

Composes `conf/benchmark.yaml`, checks the whole config up front, then for every seed runs every method one after
another, each in a fresh process (so that peak memory and state are its own), on the same data split and epochs:
full fine-tuning, head only, BitFit-like (head, biases, norm layers), a static selection of the last k tensors
chosen offline to fit the same per-step budget, Lightning's `BackboneFinetuning`, composer-style linear layer
freezing, and `ElasticTensorSelection` at each target speedup (with `benchmark.full_again`, full fine-tuning once
more after them). Each run measures its fit's wall clock (for elastic: profiling, probes and selections included),
every step's time, validation accuracy after every epoch against wall-clock time, test accuracy, peak memory and
energy (NVML on NVIDIA GPUs; elsewhere wall time x `device.power_watts`, an estimate).

Writes to the run folder: `results.csv` (one row per method and seed), `results.md` (mean and spread over seeds,
the elastic runs' own figures, the targets of the benchmark issue met or missed, accuracy at equal wall clock, and
each elastic run minus every other method paired by seed with 95% intervals), `runs.json` (everything measured,
curves and selections included), `accuracy_vs_time.png` (best accuracy so far against training seconds),
`selection_maps.png` (the selection map of every elastic run of the first seed; each run's own is
`runs/<method>_seed_<seed>_selection_map.png`); and logs every run, plus the table and plots, to TensorBoard
(`tensorboard --logdir <run folder>/tensorboard`). The methods, the measurement, the tables and the plots live in
`elastic_zoo.benchmark`; this file is the command line.

Stopped by SIGTERM or Ctrl-C, it ends the run under way and writes the same files from the runs that finished, the
report saying so, then exits with 128 + the signal's number.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from elastic_zoo.benchmark.measure import run_isolated
from elastic_zoo.benchmark.methods import Method, benchmark_problems, methods_of, run_config
from elastic_zoo.benchmark.paired import paired_report
from elastic_zoo.benchmark.plots import log_tensorboard, plot_accuracy, plot_selections
from elastic_zoo.benchmark.provenance import code_provenance
from elastic_zoo.benchmark.readout import read_out
from elastic_zoo.benchmark.report import failures, markdown_report, table_rows, write_csv
from elastic_zoo.recipe import ConfigError, build, exit_on_config_error, quiet_console


@hydra.main(config_path="../conf", config_name="benchmark", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """The command line: a config problem ends the run with its message (exit status 2), not a stack trace."""
    try:
        exit_on_config_error(run, cfg)
    except RunFailed as err:
        print(err, file=sys.stderr)
        raise SystemExit(1) from None
    except Stopped as err:
        print(f"[benchmark] stopped by {err.signal.name}; results.md holds the runs that finished", file=sys.stderr)
        raise SystemExit(128 + err.signal) from None


class RunFailed(RuntimeError):
    """Some runs ended with an error (each one's process printed its traceback; results.md lists them)."""


class Stopped(BaseException):
    """The benchmark was stopped by `signal` (SIGTERM, or SIGINT: Ctrl-C). Like `KeyboardInterrupt`, not an
    `Exception`: code that catches and wraps those (omegaconf's resolvers) lets it through."""

    def __init__(self, stopped_by: signal.Signals) -> None:
        super().__init__(stopped_by.name)
        self.signal = stopped_by


def _raise_stopped(signum: int, frame: object) -> None:
    raise Stopped(signal.Signals(signum))


def run(cfg: DictConfig) -> list[dict[str, Any]]:
    """Check the config, run every method for every seed in its own process, write the results; return the runs."""
    quiet_console()
    problems = benchmark_problems(cfg)
    methods = methods_of(cfg) if not problems else []
    # Building a run checks the data, the model and the callback's settings, whatever is wrong with the benchmark's
    # own, so that every problem is said at once: with the last elastic method whenever any is asked for (else the
    # last method), and a stand-in elastic run at 2x (seed 0) when the benchmark's settings do not say what to run.
    check, seed = Method("check", "elastic", 2.0), 0
    if methods:
        elastic = [m for m in methods if m.kind == "elastic"]
        check, seed = (elastic or methods)[-1], int(cfg.benchmark.seeds[0])
    try:
        build(OmegaConf.create(run_config(cfg, check, seed)))
    except ConfigError as err:
        problems += err.problems
    if problems:
        raise ConfigError(problems)
    code = code_provenance()  # the spawned runs import what this process imported
    print(f"[benchmark] {code.line()}", flush=True)
    if (mismatch := code.mismatch(Path(__file__).resolve().parents[1])) is not None:
        print(mismatch, file=sys.stderr, flush=True)
    output_dir = Path(cfg.paths.output_dir)
    metric = cfg.benchmark.metric
    (output_dir / "runs").mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    started = time.perf_counter()
    stopped: Stopped | None = None
    previous = signal.signal(signal.SIGTERM, _raise_stopped)
    try:
        run_all(cfg, methods, runs, started)
    except KeyboardInterrupt:
        stopped = Stopped(signal.SIGINT)
    except Stopped as err:
        stopped = err
    finally:
        signal.signal(signal.SIGTERM, previous)
    (output_dir / "runs.json").write_text(json.dumps(runs, indent=1) + "\n")
    done = [r for r in runs if "error" not in r]
    failed = [r for r in runs if "error" in r]
    fraction = float(cfg.benchmark.accuracy_fraction)
    total = len(methods) * len(cfg.benchmark.seeds)
    report = f"# Benchmark\n\nEvery run failed: nothing to compare.\n{failures(failed)}"
    if not runs:
        report = f"# Benchmark\n\nStopped before any of the {total} runs finished: nothing to compare.\n"
    if done:
        rows = table_rows(done, fraction, metric)
        write_csv(rows, output_dir / "results.csv")
        plot_accuracy(done, fraction, output_dir / "accuracy_vs_time.png", metric)
        plot_selections(done, output_dir / "selection_maps.png")
        seconds = time.perf_counter() - started
        note = None if stopped is None else f"stopped by {stopped.signal.name} after {len(runs)} of {total} runs"
        report = markdown_report(cfg, rows, seconds, code, note) + paired_report(done, metric) + failures(failed)
        log_tensorboard(done, report, fraction, output_dir, metric)
    (output_dir / "results.md").write_text(report)
    print(report)
    if stopped is not None:
        raise stopped
    if broken := [r for r in failed if "refused_at_most" not in r]:  # a refusal is the callback's answer: said above
        raise RunFailed(f"{len(broken)} of {len(runs)} runs failed; results.md lists them")
    return runs


def run_all(cfg: DictConfig, methods: list[Method], runs: list[dict[str, Any]], started: float) -> None:
    """Run every method for every seed, each in its own process, adding each result to `runs` as it ends."""
    metric = cfg.benchmark.metric
    for seed in cfg.benchmark.seeds:
        for method in methods:
            path = Path(cfg.paths.output_dir) / "runs" / f"{method.name}_seed_{seed}.json"
            result = run_isolated(run_config(cfg, method, int(seed)), method, path)
            runs.append(result)
            outcome = (
                f"FAILED: {result['error']}"
                if "error" in result
                else f"fit {result['wall_seconds']:.1f} s, final val/{metric} "
                f"{read_out([result], metric)[0]['final_accuracy']:.4f}"
            )
            print(
                f"[benchmark] {method.name} seed {seed}: {outcome}, "
                f"{time.perf_counter() - started:.0f} s since the benchmark started",
                flush=True,
            )


if __name__ == "__main__":
    main()
