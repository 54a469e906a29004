"""Solve time of the exact tensor selector (`lightning_elastic.selector.select`) on random instances.

Run from the repository root, alone on the machine's cores:

    PYTHONPATH=. flock -x /tmp/elastic-bench.lock .venv/bin/python benchmarks/selector.py

Prints a markdown table and writes it, with the date, the CPU model and this command, to
docs/selector_benchmark.md. Each row times ``--solves`` solves of fresh random instances (one warm-up solve
first) and reports the median and the 90th percentile.

Two families of instance, both with times normalised to a full backward pass of 1 and a budget of half of it:
- ``typical``: log-normal t_dw and t_dy (so the dy charge is about half the backward pass) and importances
  N(0.2, 1), some negative; the dy charge cuts the knapsack short as the deepest tensor moves to the input.
- ``worst``: t_dy = 0 and every importance positive: every tensor joins the knapsack at full width.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Literal

import numpy as np

from lightning_elastic.selector import select

Family = Literal["typical", "worst"]
# (N, resolution) -> the solve time (median, ms) the selector is meant to stay under.
TARGETS_MS = {(500, 1000): 5.0, (2000, 1000): 30.0}
DEFAULT_CASES = ["100x1000", "500x250", "500x1000", "500x4000", "1000x1000", "2000x1000"]


def random_instance(
    rng: np.random.Generator, n: int, family: Family
) -> tuple[list[float], list[float], list[float], float]:
    """t_dw, t_dy, importance and budget of one random instance (see the module docstring).

    Plain lists, as a profiler hands them over; converting them is part of the timed solve.
    """
    t_dw = rng.lognormal(0.0, 1.0, n)
    if family == "worst":
        t_dy = np.zeros(n)
        importance = np.abs(rng.normal(0.0, 1.0, n)) + 1e-3
    else:
        t_dy = rng.lognormal(0.0, 1.0, n)
        importance = rng.normal(0.2, 1.0, n)
    total = t_dw.sum() + t_dy.sum()
    return (t_dw / total).tolist(), (t_dy / total).tolist(), importance.tolist(), 0.5


def time_solves(n: int, resolution: int, family: Family, solves: int, seed: int) -> list[float]:
    """Wall-clock seconds of each solve (instances drawn before the clock starts)."""
    rng = np.random.default_rng(seed)
    instances = [random_instance(rng, n, family) for _ in range(solves + 1)]
    select(*instances[0], resolution)  # warm-up: first-call allocations and imports
    seconds = []
    for t_dw, t_dy, importance, budget in instances[1:]:
        start = time.perf_counter()
        select(t_dw, t_dy, importance, budget, resolution)
        seconds.append(time.perf_counter() - start)
    return seconds


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def parse_case(text: str) -> tuple[int, int]:
    try:
        n, resolution = (int(part) for part in text.lower().split("x"))
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"a case is NxR, e.g. 500x1000. Found: {text!r}") from err
    if n < 1 or resolution < 1:
        raise argparse.ArgumentTypeError(f"N and R must be >= 1. Found: {text!r}")
    return n, resolution


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--cases",
        nargs="+",
        type=parse_case,
        default=[parse_case(c) for c in DEFAULT_CASES],
        metavar="NxR",
        help=f"tensor count x resolution pairs (default: {' '.join(DEFAULT_CASES)})",
    )
    parser.add_argument("--families", nargs="+", choices=["typical", "worst"], default=["typical", "worst"])
    parser.add_argument("--solves", type=int, default=30, help="timed solves per row (>= 20 for the docs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=Path("docs/selector_benchmark.md"))
    args = parser.parse_args(argv)
    if args.solves < 1:
        parser.error(f"`--solves` must be >= 1. Found: {args.solves}")

    rows = [
        "| instances | N | R | median (ms) | p90 (ms) | target (ms) | met |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for family in args.families:
        for n, resolution in args.cases:
            ms = sorted(1e3 * s for s in time_solves(n, resolution, family, args.solves, args.seed))
            median = statistics.median(ms)
            p90 = ms[min(len(ms) - 1, int(np.ceil(0.9 * len(ms))) - 1)]
            target = TARGETS_MS.get((n, resolution))
            met = "" if target is None else ("yes" if median <= target else "**no**")
            rows.append(
                f"| {family} | {n} | {resolution} | {median:.2f} | {p90:.2f} | "
                f"{'' if target is None else f'{target:g}'} | {met} |"
            )
            print(rows[-1], flush=True)

    command = "PYTHONPATH=. flock -x /tmp/elastic-bench.lock .venv/bin/python " + shlex.join(
        ["benchmarks/selector.py", *(argv if argv is not None else sys.argv[1:])]
    )
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    report = "\n".join(
        [
            "# Selector solve time",
            "",
            "Wall-clock time of one `lightning_elastic.selector.select` call (quantisation, dynamic program and",
            f"backtracking), over {args.solves} random instances per row after one warm-up solve.",
            "`typical`: log-normal t_dw and t_dy, importances N(0.2, 1), budget half the backward pass;",
            "`worst`: t_dy = 0 and every importance positive, so every tensor joins the knapsack at full width.",
            "",
            f"- Date: {now}",
            f"- CPU: {cpu_model()} ({platform.machine()}), Python {platform.python_version()}, "
            f"numpy {np.__version__}",
            f"- Command: `{command}`",
            "",
            *rows,
            "",
        ]
    )
    print()
    print(report)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(report)


if __name__ == "__main__":
    main()
