"""Peak memory of a fit with `ElasticTensorSelection` against full fine-tuning, phase by phase, and what holds it.

Each run is a fresh process (a first fit: profiling inside the fit's first step, no cache) that reads two figures at
marks: the resident set's high-water mark (`VmHWM` in /proc/self/status: what the machine sees, but the allocator's
fragmentation moves it by tens of MiB; `--rss-only` reads it without the profiler, whose records grow it) and the
exact bytes of live tensors, from the allocation events of `torch.profiler` (`total_allocated`, bytes allocated since
the fit started minus those freed: every CPU tensor, activations and autograd's saved tensors included). The tensor
figure is the one to attribute with: its peak within each phase is exact and the same from run to run. Phases: the
first step up to its update (`step 1`; for elastic its forward and backward pass, then `profiling`, the profile's
passes), the steps that follow, and, inside profiling, each kind of pass. At the start of profiling the script also
counts what the first step holds (its gradients) and what the profile's passes keep between passes (input leaves and
their gradients, kept through the autograd nodes of a pass's record), and, at every mark, glibc's heap (`mallinfo2`:
its size, of which free, and the bytes mapped outside it): the resident set grows when fragmentation leaves no free
block large enough. `MALLOC_MMAP_THRESHOLD_=131072` in the environment puts every block above 128 KiB outside the
heap, returned to the system when freed: the resident set then follows live memory, the same from run to run.

Models: ``linear`` (6 x Linear(1024, 1024): weights dominate) and ``lite0`` (EfficientNet-Lite0 on ELPV at 96 px,
batch 32: the real case). Optimizers: Adam and momentum SGD.

Run (figures in docs/memory.md)::

    flock -x /tmp/elastic-bench.lock env PYTHONPATH=. .venv/bin/python benchmarks/memory.py \\
        --model lite0 --optimizer adam --runs 2
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, record_function
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.trainers import quiet_trainer
from lightning_elastic import ElasticTensorSelection
from lightning_elastic.profiling import harness, passes

MARK = "memory-mark:"
MiB = 2**20


def vm_hwm_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise OSError("no VmHWM in /proc/self/status")


RSS: dict[str, float] = {}  # VmHWM at each mark
HEAP: dict[str, list[float]] = {}  # glibc's heap at each mark (`heap_mib`)
MALLINFO2 = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in MALLINFO2]


def heap_mib() -> list[float]:
    """glibc's heap (arena bytes, of which free) and mmapped bytes, MiB."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    return [info.arena / MiB, info.fordblks / MiB, info.hblkhd / MiB]


def mark(name: str) -> None:
    """A point in the profiler's timeline (an empty range named ``MARK + name``), with VmHWM read there."""
    with record_function(MARK + name):
        pass
    RSS[name] = max(RSS.get(name, 0.0), vm_hwm_mib())
    HEAP[name] = heap_mib()


class Marks(L.Callback):
    """Marks every step's start and update, reads VmHWM after each step, and stops after `steps`."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.hwm: dict[str, float] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts from the resident set
        self.hwm["train start"] = vm_hwm_mib()

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        mark(f"step {trainer.global_step + 1}")

    def on_before_optimizer_step(self, trainer: L.Trainer, *args: Any) -> None:
        mark(f"update {trainer.global_step + 1}")

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.hwm[f"after step {trainer.global_step}"] = vm_hwm_mib()
        if trainer.global_step >= self.steps:
            trainer.should_stop = True


HELD: dict[str, float] = {}


def instrument() -> None:
    """Mark profiling and its passes, and count at its start what the first step holds."""
    measure = harness.profile

    def profile(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        grads = {p.grad.untyped_storage().data_ptr(): p.grad.nbytes for p in model.parameters() if p.grad is not None}
        HELD["the first step's gradients"] = sum(grads.values()) / MiB
        mark("profiling")
        try:
            return measure(model, *args, **kwargs)
        finally:
            mark("profiling end")

    harness.profile = profile  # type: ignore[assignment]
    for kind in ("plain", "instrumented"):
        original = getattr(passes.Runner, kind)

        def wrapped(self: passes.Runner, *args: Any, _original: Any = original, _kind: str = kind, **kw: Any) -> Any:
            label = _kind if _kind == "plain" else f"instrumented {args[0] if args else kw['kind']}"
            mark(f"pass {label}")
            out = _original(self, *args, **kw)
            mark(f"pass end {label}")
            return out

        setattr(passes.Runner, kind, wrapped)
    original_costs = passes.Structure.costs

    def costs(self: Any, full: list[Any], dx: list[Any], none: list[Any]) -> Any:
        HELD["kept by the passes' records"] = kept_bytes([*full, *dx, *none]) / MiB
        return original_costs(self, full, dx, none)

    passes.Structure.costs = costs  # type: ignore[method-assign]


def kept_bytes(passes: list[Any]) -> int:
    """Bytes of the non-parameter leaves (and their gradients) that the passes' autograd nodes keep alive."""
    storages: dict[int, int] = {}
    for record in passes:
        for node in record.leaf_nodes:
            leaf = node.variable
            if isinstance(leaf, nn.Parameter):
                continue
            for t in (leaf, leaf.grad):
                if t is not None:
                    storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def allocations(prof: torch.profiler.profile) -> tuple[list[tuple[int, int]], dict[str, list[int]]]:
    """(time, total bytes allocated) of every allocation and free, and the times of every mark."""
    events: list[tuple[int, int]] = []
    marks: dict[str, list[int]] = {}
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.tag == _EventType.Allocation:
            events.append((event.start_time_ns, event.extra_fields.total_allocated))
        elif event.name.startswith(MARK):
            marks.setdefault(event.name[len(MARK) :], []).append(event.start_time_ns)
        stack.extend(event.children)
    events.sort()
    return events, marks


def phases(events: list[tuple[int, int]], marks: dict[str, list[int]]) -> dict[str, float]:
    """Peak MiB of live tensors (above the fit's start) in each phase between marks."""
    bounds = sorted((t, name) for name, times in marks.items() for t in times)
    spans: list[tuple[str, int, int]] = []
    steps = [(t, n) for t, n in bounds if n.startswith(("step ", "update "))] + [(events[-1][0] + 1, "end")]
    for (start, name), (end, _) in itertools.pairwise(steps):
        spans.append((name if name.startswith("step") else f"{name} (the update)", start, end))
    opened: dict[str, int] = {}
    for t, name in bounds:
        if name in ("profiling", "profiling end"):
            if name == "profiling":
                opened["profiling"] = t
            else:
                spans.append(("profiling", opened.pop("profiling"), t))
        elif name.startswith("pass end "):
            kind = name[len("pass end ") :]
            spans.append((f"  pass: {kind}", opened.pop(kind), t))
        elif name.startswith("pass "):
            opened[name[len("pass ") :]] = t
    peaks: dict[str, float] = {}
    for name, start, end in spans:
        inside = [total for t, total in events if start <= t < end]
        if inside:
            peaks[name] = max(peaks.get(name, float("-inf")), max(inside) / MiB)
    return peaks


class Linear6(L.LightningModule):
    def __init__(self, optimizer: str) -> None:
        super().__init__()
        self.net = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(6)])
        self.optimizer_name = optimizer

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=1e-3, momentum=0.9)
        return torch.optim.Adam(self.parameters(), lr=1e-4)


def fit(model: str, optimizer: str, elastic: bool, steps: int, tensors: bool) -> dict[str, Any]:
    """One fit in this process; its figures."""
    L.seed_everything(0, verbose=False)
    module: L.LightningModule
    if model == "linear":
        module = Linear6(optimizer)
        data: Any = DataLoader(TensorDataset(torch.randn(1024, 1024), torch.randn(1024, 1024)), batch_size=32)
    else:
        from elastic_zoo.data import ElpvDataModule
        from elastic_zoo.models import efficientnet_lite0
        from elastic_zoo.module import ImageClassifier

        data = ElpvDataModule(image_size=96, batch_size=32, seed=0, val_fraction=0.15, test_fraction=0.15)
        module = ImageClassifier(efficientnet_lite0(num_classes=4), num_classes=4, optimizer=optimizer, lr=3e-4)
    marks = Marks(steps)
    callbacks: list[L.Callback] = [marks]
    if elastic:
        instrument()
        callbacks.append(ElasticTensorSelection(speedup=1.2, cache_dir=False, log_images=False, calibrate=False))
    trainer = quiet_trainer(callbacks, max_epochs=1)
    kwargs = {"train_dataloaders": data} if model == "linear" else {"datamodule": data}
    if not tensors:  # the profiler's records grow the resident set: without it, VmHWM is the fit's own
        trainer.fit(module, **kwargs)
        return {"tensors": {}, "hwm": {**marks.hwm, **RSS}, "held": dict(HELD), "heap": HEAP}
    with torch.profiler.profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        trainer.fit(module, **kwargs)
    events, times = allocations(prof)
    return {"tensors": phases(events, times), "hwm": {**marks.hwm, **RSS}, "held": dict(HELD)}


def runs(args: argparse.Namespace) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each run in a fresh process, full fine-tuning and elastic in turn."""
    for i in range(args.runs):
        for which in ("full", "elastic"):
            command = [sys.executable, __file__, "--one", which, "--model", args.model, "--optimizer", args.optimizer]
            command += ["--steps", str(args.steps)] + (["--rss-only"] if args.rss_only else [])
            out = subprocess.run(command, capture_output=True, text=True, check=True)
            yield f"{which} {i + 1}", json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("linear", "lite0"), default="linear")
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--runs", type=int, default=1, help="fresh processes of each kind")
    parser.add_argument("--rss-only", action="store_true", help="no torch.profiler: VmHWM alone, undisturbed")
    parser.add_argument("--one", choices=("full", "elastic"), help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(fit(args.model, args.optimizer, args.one == "elastic", args.steps, not args.rss_only)))
        return
    results = dict(runs(args))
    print(f"{args.model}, {args.optimizer}: peak MiB of live tensors above the fit's start, by phase")
    names = list(dict.fromkeys(n for r in results.values() for n in r["tensors"]))
    print("| phase | " + " | ".join(results) + " |\n|---|" + "---|" * len(results))
    for name in names:
        cells = [f"{r['tensors'][name]:.1f}" if name in r["tensors"] else "" for r in results.values()]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("\nresident-set high-water mark (MiB)")
    marks = list(dict.fromkeys(n for r in results.values() for n in r["hwm"]))
    print("| mark | " + " | ".join(results) + " |\n|---|" + "---|" * len(results))
    for name in marks:
        print(f"| {name} | " + " | ".join(f"{r['hwm'].get(name, float('nan')):.0f}" for r in results.values()) + " |")
    print("\nglibc heap at marks: arena / of which free / mmapped (MiB)")
    for name in marks:
        heaps = [r.get("heap", {}).get(name) for r in results.values()]
        if any(heaps):
            print(f"| {name} | " + " | ".join("/".join(f"{v:.0f}" for v in h) if h else "" for h in heaps) + " |")
    for label, result in results.items():
        if result["held"]:
            print(f"{label}: " + ", ".join(f"{k} {v:.1f} MiB" for k, v in result["held"].items()))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
