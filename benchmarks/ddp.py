"""Bytes all-reduced per step, and step time, of DDP's own communication against `selective_allreduce_hook`.

Run from the repository root, alone on the machine's cores:

    PYTHONPATH=. flock -x /tmp/elastic-bench.lock .venv/bin/python benchmarks/ddp.py

Two gloo processes on this machine's CPU train a real network (random weights: only shapes and times matter)
under `DistributedDataParallel(find_unused_parameters=True)`, with a fixed selection applied through
`requires_grad` as `ElasticTensorSelection` applies it. For each selection, the same steps run twice: with DDP's
own all-reduce, which sends every bucket whole (frozen slots as zeros), and with `selective_allreduce_hook`, which
sends only the slots of trained tensors. Selections: the output-side x% of the tensors (what a backward-time
budget favours: backward stops at the deepest trained tensor) and BatchNorm + biases (many small scattered
tensors: the hook packs them). Prints a markdown table: bytes per step counted by the hook, the reducer's own
map of used tensors (4 bytes per tensor, sent in both cases), the median time of forward + backward with its
communication (`--rounds` rounds of `--steps` steps each way, interleaved, one process per core), and the time
spent in the hook itself per step (launching all-reduces, not waiting for them).
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import socket
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_elastic.distributed import USED_MAP_BYTES_PER_TENSOR, SelectiveAllReduce, selective_allreduce_hook

WORLD_SIZE = 2


def build(name: str) -> nn.Module:
    import torchvision

    from elastic_zoo.models import efficientnet_lite0

    if name == "efficientnet_lite0":
        return efficientnet_lite0(num_classes=10, pretrained=False)
    return getattr(torchvision.models, name)(weights=None, num_classes=10)


def selections(model: nn.Module) -> dict[str, list[bool]]:
    """Named masks over `model.parameters()` in forward order."""
    names = [n for n, _ in model.named_parameters()]
    norm = {
        f"{m}.{p}"
        for m, module in model.named_modules()
        if isinstance(module, nn.modules.batchnorm._BatchNorm)
        for p, _ in module.named_parameters(recurse=False)
    }
    n = len(names)
    masks = {f"last {f:.0%} of tensors": [k >= n - round(f * n) for k in range(n)] for f in (1.0, 0.5, 0.25, 0.1)}
    masks["BatchNorm + biases"] = [name in norm or name.endswith("bias") for name in names]
    return masks


class HookClock:
    """Seconds spent in `selective_allreduce_hook` itself (launching the all-reduce, not waiting for it)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def hook(self, state, bucket):  # no annotations: DDP compares them with its own classes
        started = time.perf_counter()
        future = selective_allreduce_hook(state, bucket)
        self.seconds += time.perf_counter() - started
        return future


def timed_steps(
    model: DistributedDataParallel, images: torch.Tensor, labels: torch.Tensor, count: int, clock: HookClock
) -> list[float]:
    """Seconds of forward + backward (with its all-reduce) of `count` steps after one warm-up step."""
    times = []
    for step in range(count + 1):
        if step == 1:
            clock.seconds = 0.0  # the warm-up step checks masks across ranks: a blocking all-reduce per bucket
        dist.barrier()
        started = time.perf_counter()
        nn.functional.cross_entropy(model(images), labels).backward()
        times.append(time.perf_counter() - started)
        for p in model.parameters():
            p.grad = None
    return times[1:]


def measure(
    net: nn.Module, mask: list[bool], selective: bool, images: torch.Tensor, labels: torch.Tensor, count: int
) -> tuple[list[float], SelectiveAllReduce | None, float]:
    """Wrap `net` with every tensor trainable (as Lightning does), apply `mask`, time `count` steps."""
    params = list(net.parameters())
    for p in params:
        p.requires_grad_(True)
    ddp = DistributedDataParallel(net, find_unused_parameters=True)
    clock = HookClock()
    state = None
    if selective:
        state = SelectiveAllReduce(ddp.process_group, net)
        ddp.register_comm_hook(state, clock.hook)
    for p, m in zip(params, mask, strict=True):
        p.requires_grad_(m)
    times = timed_steps(ddp, images, labels, count, clock)
    hook_seconds = clock.seconds / count
    return times, state, hook_seconds


def worker(rank: int, port: int, names: list[str], rounds: int, count: int, batch: int, size: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE, timeout=timedelta(minutes=10))
    torch.set_num_threads(1)  # one core per process
    for name in names:
        torch.manual_seed(0)
        net = build(name)
        params = list(net.parameters())
        images = torch.randn(batch, 3, size, size)
        labels = torch.randint(0, 10, (batch,))
        for label, mask in selections(net).items():
            default: list[float] = []
            selective: list[float] = []
            hook_seconds: list[float] = []
            for _ in range(rounds):  # interleaved, so that load from elsewhere hits both alike
                default += measure(net, mask, False, images, labels, count)[0]
                times, state, seconds = measure(net, mask, True, images, labels, count)
                selective += times
                hook_seconds.append(seconds)
            assert state is not None
            trained = sum(p.numel() for p, m in zip(params, mask, strict=True) if m)
            if rank == 0:
                out[(name, label)] = dict(
                    tensors=sum(mask) / len(mask),
                    elements=trained / sum(p.numel() for p in params),
                    sent=state.last_step_bytes,
                    full=state.last_step_full_bytes,
                    used_map=USED_MAP_BYTES_PER_TENSOR * len(params),
                    default_s=statistics.median(default),
                    selective_s=statistics.median(selective),
                    hook_s=statistics.median(hook_seconds),
                )
    dist.destroy_process_group()


def table(rows: dict) -> str:
    lines = [
        "| model | selection | tensors | elements | sent / step (MB) | DDP's own / step (MB) | sent / DDP's own "
        "| used map (B) | step, DDP's own (ms) | step, selective (ms) | in hook (ms) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (name, label), r in rows.items():
        lines.append(
            f"| {name} | {label} | {r['tensors']:.0%} | {r['elements']:.1%} | {r['sent'] / 1e6:.2f} | "
            f"{r['full'] / 1e6:.2f} | {r['sent'] / r['full']:.3f} | {r['used_map']:.0f} | "
            f"{r['default_s'] * 1e3:.0f} | {r['selective_s'] * 1e3:.0f} | {r['hook_s'] * 1e3:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["resnet50", "efficientnet_lite0"])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of DDP's own then selective, per selection")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round, after one warm-up step")
    parser.add_argument("--batch", type=int, default=4, help="images per process")
    parser.add_argument("--size", type=int, default=64, help="image side in pixels")
    args = parser.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    manager = mp.Manager()
    rows = manager.dict()
    mp.spawn(worker, args=(port, args.models, args.rounds, args.steps, args.batch, args.size, rows), nprocs=WORLD_SIZE)
    report = table(dict(rows))
    print(f"CPU: {platform.processor() or platform.machine()}, torch {torch.__version__}, gloo, 2 processes")
    print("Command: " + shlex.join(["PYTHONPATH=.", "flock -x /tmp/elastic-bench.lock", ".venv/bin/python", *sys.argv]))
    print(report)
    return report


if __name__ == "__main__":
    main()
