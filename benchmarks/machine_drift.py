"""How much the machine's own speed moves while nothing changes: the same training step, timed without a break.

One process trains EfficientNet-Lite0 (ImageNet weights, a new 2-class head) with Adam on one fixed random batch
(32 images of 96 px, the benchmark's ELPV setting) for ``--seconds``, and prints the median step of every
``--window`` steps: a fixed workload, so every change of the medians is the machine's, not the code's. Run it in
fresh processes one after another to see how far one process's speed lies from the next one's. The figures tell how
finely two runs of `recipes/benchmark.py` can be compared at all (docs/results.md).

Run (the figures in docs/results.md, 2026-11-26)::

    flock -x /tmp/elastic-bench.lock env PYTHONPATH=. .venv/bin/python benchmarks/machine_drift.py --seconds 240
    for i in 1 2 3 4 5 6; do flock -x /tmp/elastic-bench.lock env PYTHONPATH=. .venv/bin/python \\
        benchmarks/machine_drift.py --seconds 15; done
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from elastic_zoo.models import efficientnet_lite0


def step_times(net: nn.Module, seconds: float, batch: int = 32, size: int = 96) -> list[tuple[float, float]]:
    """(seconds since the start, duration) of every training step of `net` on one fixed batch, for `seconds`."""
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(batch, 3, size, size, generator=generator)
    labels = torch.randint(0, 2, (batch,), generator=generator)
    optimizer = torch.optim.Adam(net.parameters(), lr=3e-4)
    start = time.perf_counter()
    times = []
    while (now := time.perf_counter()) - start < seconds:
        optimizer.zero_grad()
        nn.functional.cross_entropy(net(images), labels).backward()
        optimizer.step()
        times.append((now - start, time.perf_counter() - now))
    return times


def windows(times: list[tuple[float, float]], window: int) -> list[tuple[float, float]]:
    """(end of the window in seconds, median step) of each run of `window` steps; a shorter last one is left out.

    Example:
        >>> windows([(0.0, 1.0), (1.0, 3.0), (4.0, 2.0), (6.0, 5.0), (11.0, 1.0)], 2)
        [(4.0, 2.0), (11.0, 3.5)]
    """
    full = len(times) - len(times) % window
    return [
        (times[i + window - 1][0] + times[i + window - 1][1], statistics.median(d for _, d in times[i : i + window]))
        for i in range(0, full, window)
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=240.0, help="how long to time steps (default 240)")
    parser.add_argument("--window", type=int, default=25, help="steps per median (default 25)")
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out: the process warms up (5)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    times = step_times(efficientnet_lite0(num_classes=2, pretrained=True), args.seconds)[args.warmup :]
    medians = windows(times, args.window)
    if not medians:
        parser.error(
            f"--seconds must leave --warmup + --window ({args.warmup} + {args.window}) steps to time. Found: "
            f"{len(times) + args.warmup} steps in --seconds {args.seconds:g}"
        )
    print(f"| seconds | median of {args.window} steps (ms) |\n|---:|---:|")
    for end, median in medians:
        print(f"| {end:.0f} | {median * 1e3:.0f} |")
    overall = statistics.median(d for _, d in times)
    low, high = min(m for _, m in medians), max(m for _, m in medians)
    print(
        f"\n{len(times)} steps after {args.warmup} warm-up steps, {torch.get_num_threads()} threads: median step "
        f"{overall * 1e3:.0f} ms; medians of {args.window} steps from {low * 1e3:.0f} to {high * 1e3:.0f} ms "
        f"({high / low:.2f}x)"
    )


if __name__ == "__main__":
    main()
