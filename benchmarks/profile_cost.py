"""Where a first profile's time goes, phase by phase, inside a real fit.

Runs a short fit of EfficientNet-Lite0 (ImageNet weights) on ELPV in a fresh process, with `ElasticTensorSelection`
profiling on the first batch (no cache: a first run on the machine), and times every phase of profiling by wrapping
the profiler's functions: the first batch, the snapshot of the model, the fingerprint's pass, each instrumented pass,
attribution, the plain timings of calibration (each pass), the cache, garbage collection (inside the others), and
the whole on the callback's clock. Figures are in seconds and in full steps (the profile's plain forward + full
backward). The training steps are timed too (the first holds the profile when it runs inside that step);
``--baseline`` times the same fit without the callback, whose first step carries the process's warm-up, and tells
whether a fresh process runs its first steps slower than later ones (it did not, docs/results.md).

Run (the figures in docs/time_model.md; each run is a fresh process, as a first fit is)::

    for i in 1 2 3; do flock -x /tmp/elastic-bench.lock env PYTHONPATH=. .venv/bin/python \\
        benchmarks/profile_cost.py --json outputs/profile_cost_$i.json; done
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch

from benchmarks.trainers import quiet_trainer
from elastic_zoo.data import ElpvDataModule
from elastic_zoo.models import efficientnet_lite0
from elastic_zoo.module import ImageClassifier
from lightning_elastic import ElasticTensorSelection, callback
from lightning_elastic.profiling import attribution, harness, passes, runner, state

SPANS: dict[str, list[float]] = defaultdict(list)


def timed(owner: Any, name: str, label: str) -> None:
    """Replace ``owner.name`` by a wrapper that adds each call's seconds to ``SPANS[label]``."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            SPANS[label].append(time.perf_counter() - start)

    setattr(owner, name, wrapper)


def instrument() -> None:
    timed(callback, "measure_profile", "total (the callback's clock)")
    timed(harness, "_first_batch", "first batch")
    timed(state.ModelState, "__init__", "model snapshot")
    timed(state.ModelState, "restore", "model restore")
    timed(passes.Runner, "signature", "fingerprint pass")
    timed(runner, "cache_key", "fingerprint hash")  # the first step's key (runner), a pass's own (passes)
    timed(passes, "cache_key", "fingerprint hash")
    original_instrumented = passes.Runner.instrumented

    def instrumented(self: passes.Runner, kind: str, keep: Callable[..., Any] | None = None) -> Any:
        start = time.perf_counter()
        try:
            return original_instrumented(self, kind, keep)  # type: ignore[arg-type]
        finally:
            SPANS[f"instrumented pass: {kind}"].append(time.perf_counter() - start)

    passes.Runner.instrumented = instrumented  # type: ignore[method-assign]
    timed(passes.Runner, "_timed_backward", "  of which hooked backward")
    timed(attribution.Structure, "__init__", "attribution: structure")
    timed(attribution.Structure, "costs", "attribution: costs")
    timed(passes, "full_step_times", "plain timings of the full step")
    timed(passes.Runner, "plain", "  of which plain passes")
    timed(runner, "store", "cache write")
    timed(runner, "load_cached", "cache read")
    started: list[float] = []

    def gc_clock(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            SPANS[f"garbage collection (generation {info['generation']})"].append(time.perf_counter() - started.pop())

    gc.callbacks.append(gc_clock)


class StepTimes(L.Callback):
    """Wall seconds of every training step (batch start to batch end), and stop after ``steps``."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.seconds: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.seconds.append(time.perf_counter() - self._start)
        if len(self.seconds) >= self.steps:
            trainer.should_stop = True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image-size", type=int, default=96)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=12, help="training steps after profiling")
    parser.add_argument("--baseline", action="store_true", help="the same fit without the callback")
    parser.add_argument("--cache-dir", type=Path, help="profile cache (default: none, a first run)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    instrument()
    L.seed_everything(0, verbose=False)
    data = ElpvDataModule(image_size=args.image_size, batch_size=args.batch_size, seed=0)
    module = ImageClassifier(efficientnet_lite0(num_classes=4), num_classes=4, lr=3e-4)
    steps = StepTimes(args.steps)
    elastic = ElasticTensorSelection(speedup=2.0, cache_dir=args.cache_dir or False, log_images=False)
    callbacks: list[L.Callback] = [steps] if args.baseline else [steps, elastic]
    trainer = quiet_trainer(callbacks, max_epochs=5, limit_train_batches=30)
    trainer.fit(module, datamodule=data)
    warm = statistics.median(steps.seconds[2:]) if len(steps.seconds) > 3 else float("nan")
    prof = None if args.baseline else elastic.timing_profile
    full = prof.t_full if prof is not None else warm
    print(f"steps (s): {' '.join(f'{s:.3f}' for s in steps.seconds)}")
    print(f"full step: profile's forward+backward {full:.3f} s, training steps 3+ (median) {warm:.3f} s")
    for label, values in SPANS.items():
        total = sum(values)
        each = " ".join(f"{v:.3f}" for v in values[:12]) if len(values) > 1 else ""
        print(f"{label:44s} {len(values):3d} x {total:7.3f} s {total / full:6.2f} full steps  {each}")
    if prof is not None:
        print(f"profile_seconds (the profiler's own clock): {prof.profile_seconds:.3f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "torch": torch.__version__,
                    "threads": torch.get_num_threads(),
                    "steps": steps.seconds,
                    "t_full": full,
                    "spans": {k: list(v) for k, v in SPANS.items()},
                    "profile_seconds": prof.profile_seconds if prof is not None else None,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
