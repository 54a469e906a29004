"""Is a fresh process slow in its first training steps? Plain Lite0 steps timed from the process's first one.

A cached profile leaves a fit no profiling passes before its first probe steps, which measure the full step `T` of
the wall-clock contract; if a fresh process ran its first steps slower than later ones, that `T` would come out too
high. This times `--steps` plain training steps (forward, backward, Adam update; no Lightning) of EfficientNet-Lite0
on a random batch and prints each step and the mean of steps 1-3 over the mean of steps 10 on. Run it several times,
each a fresh process, holding the machine:

    for i in 1 2 3 4; do flock -x /tmp/elastic-bench.lock .venv/bin/python benchmarks/first_steps.py; done
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from elastic_zoo.models import efficientnet_lite0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="training steps to time (at least 11)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=96)
    args = parser.parse_args(argv)
    if args.steps < 11:
        parser.error(f"--steps must be at least 11. Found: {args.steps}")
    torch.manual_seed(0)
    model = efficientnet_lite0(num_classes=4, pretrained=False)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-4)
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    y = torch.randint(0, 4, (args.batch_size,))
    seconds = []
    for _ in range(args.steps):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        seconds.append(time.perf_counter() - start)
    later = seconds[10:]
    print("steps (ms):", " ".join(f"{s * 1e3:.0f}" for s in seconds))
    print("\n| step 0 (ms) | steps 1-3 / steps 10+ | steps 10+: mean (ms) | steps 10+: sd / mean |")
    print("|---:|---:|---:|---:|")
    print(
        f"| {seconds[0] * 1e3:.0f} | {statistics.mean(seconds[1:4]) / statistics.mean(later):.3f} "
        f"| {statistics.mean(later) * 1e3:.0f} | {statistics.stdev(later) / statistics.mean(later):.3f} |"
    )


if __name__ == "__main__":
    main()
