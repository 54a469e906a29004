"""Does a probe window's importance pick the tensors whose training lowers the held-out loss?

The importance benchmark (benchmarks/importance.py) checks each estimate against the loss drop on the batch
that made the update. A selection needs more: the tensors it picks must lower the loss on data not yet seen,
over the interval it then trains. This script measures that directly, on the benchmark's setting
(EfficientNet-Lite0 with ImageNet weights, ELPV, 96 px, batch 32, Adam 3e-4, head always trained):

1. Warm-up (train mode): ``--head-steps`` of the new head alone, then ``--full-steps`` of everything.
2. A probe window: ``--window`` full training steps with every estimate summed over the window: the callback's
   ``-g.dw`` (before-gradient), the same per element and per square root of elements, and the squared gradient
   norm. The window's own truth: the held-out loss drop of applying the window's total update of tensor k alone
   (validation batches, eval mode).
3. Selections at one predicted step cost (``1 / --speedup`` of a full step, the measured time model, the callback's
   `decide`): one per estimate, the held-out truth of the window as an oracle, and static last-k (the head plus
   the largest suffix of tensors that fits).
4. Each selection trains ``--interval`` steps from the same state (weights and optimizer after the window), on
   the same batches; reported: held-out loss and accuracy after it, and against static last-k. A second window
   from the same state gives each estimate's rank stability (Spearman between the two windows).

Not a timing benchmark (it measures losses): PYTHONPATH=. .venv/bin/python benchmarks/selection_value.py
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from scipy.stats import spearmanr
from torch import Tensor, nn

from elastic_zoo.baselines import last_k_within_budget
from elastic_zoo.data import ElpvDataModule
from elastic_zoo.models import efficientnet_lite0
from lightning_elastic.importance import ImportanceEvaluator
from lightning_elastic.profiling import profile
from lightning_elastic.selector import decide
from lightning_elastic.time_model import StepTimeModel

Batch = tuple[Tensor, Tensor]
HEAD = "_fc."
ESTIMATES = ("before", "per_element", "per_sqrt_element", "grad_squared")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--head-steps", type=int, default=40)
    parser.add_argument("--full-steps", type=int, default=40)
    parser.add_argument("--window", type=int, default=10, help="full steps of the probe window")
    parser.add_argument("--interval", type=int, default=40, help="steps each selection trains")
    parser.add_argument("--speedup", type=float, default=2.0)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--val-batches", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=96)
    args = parser.parse_args(argv)
    if min(args.head_steps, args.full_steps) < 0 or min(args.window, args.interval, args.val_batches) < 1:
        parser.error("step counts must be non-negative (warm-up) or positive (window, interval, val batches)")
    if not args.speedup > 1:
        parser.error(f"`--speedup` must be > 1. Found: {args.speedup}")
    return args


def cycle(loader: torch.utils.data.DataLoader[Batch]) -> Iterator[Batch]:
    while True:
        yield from loader


def loss_of(model: nn.Module, batch: Batch) -> Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def held_out(model: nn.Module, batches: Sequence[Batch]) -> tuple[float, float]:
    """Mean loss and accuracy on `batches`, eval mode (the model's mode is restored)."""
    was_training = model.training
    model.eval()
    losses, correct, total = [], 0, 0
    with torch.no_grad():
        for images, labels in batches:
            logits = model(images)
            losses.append(float(F.cross_entropy(logits, labels)) * len(labels))
            correct += int((logits.argmax(1) == labels).sum())
            total += len(labels)
    model.train(was_training)
    return math.fsum(losses) / total, correct / total


def train_steps(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Sequence[Batch],
    mask: Sequence[bool] | None = None,
    before: Callable[[], None] | None = None,
    after: Callable[[], None] | None = None,
) -> None:
    """Train mode steps on `batches`; with `mask`, only those tensors require grad (others get no gradient).

    `before` runs when the gradients are final, `after` once the optimizer has stepped.
    """
    params = list(model.parameters())
    for p, flag in zip(params, mask or [True] * len(params), strict=True):
        p.requires_grad_(flag)
    model.train()
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        loss_of(model, batch).backward()
        if before is not None:
            before()
        optimizer.step()
        if after is not None:
            after()
    for p in params:
        p.requires_grad_(True)


def window_estimates(
    model: nn.Module, optimizer: torch.optim.Optimizer, batches: Sequence[Batch]
) -> dict[str, Tensor]:
    """Every estimate summed over a window of full training steps on `batches`."""
    params = list(model.parameters())
    numel = torch.tensor([p.numel() for p in params], dtype=torch.float64)
    evaluator = ImportanceEvaluator(params)
    squared = torch.zeros(len(params), dtype=torch.float64)

    def before() -> None:
        evaluator.before_step()
        for k, p in enumerate(params):
            if p.grad is not None:
                squared[k] += float(p.grad.double().square().sum())

    train_steps(model, optimizer, batches, before=before, after=evaluator.after_step)
    evaluator.finish()
    before = evaluator.importance.double()
    return {
        "before": before,
        "per_element": before / numel,
        "per_sqrt_element": before / numel.sqrt(),
        "grad_squared": squared,
    }


def single_tensor_drops(model: nn.Module, start: Sequence[Tensor], val: Sequence[Batch]) -> Tensor:
    """Held-out loss drop of moving each tensor alone from `start` to its current value."""
    params = list(model.parameters())
    end = [p.detach().clone() for p in params]
    drops = torch.zeros(len(params), dtype=torch.float64)
    with torch.no_grad():
        for p, w in zip(params, start, strict=True):
            p.copy_(w)
        base = held_out(model, val)[0]
        for k, p in enumerate(params):
            p.copy_(end[k])
            drops[k] = base - held_out(model, val)[0]
            p.copy_(start[k])
        for p, w in zip(params, end, strict=True):
            p.copy_(w)
    return drops


def spearman(x: Tensor, y: Tensor) -> float:
    return float(spearmanr(x.numpy(), y.numpy()).statistic)


def one_seed(args: argparse.Namespace, seed: int) -> dict[str, dict[str, float]]:
    torch.manual_seed(seed)
    data = ElpvDataModule(image_size=args.image_size, batch_size=args.batch_size, seed=seed)
    data.setup()
    train = cycle(data.train_dataloader())
    val = list(data.val_dataloader())[: args.val_batches]
    model = efficientnet_lite0(num_classes=data.num_classes)
    names = [n for n, _ in model.named_parameters()]
    head = [n.startswith(HEAD) for n in names]
    params = list(model.parameters())
    for p, h in zip(params, head, strict=True):
        p.requires_grad_(h)
    train_steps(model, torch.optim.Adam([p for p, h in zip(params, head, strict=True) if h], lr=1e-3),
                [next(train) for _ in range(args.head_steps)], mask=head)
    optimizer = torch.optim.Adam(params, lr=args.lr)
    train_steps(model, optimizer, [next(train) for _ in range(args.full_steps)])

    first = next(train)
    prof = profile(model, lambda: loss_of(model, first))
    costs = StepTimeModel.from_profile(prof)
    order = [names.index(n) for n in prof.names]  # profile order (forward order) -> parameter index

    start = [p.detach().clone() for p in params]
    window = [next(train) for _ in range(args.window)]
    estimates = window_estimates(model, optimizer, window)
    estimates["oracle_window"] = single_tensor_drops(model, start, val)
    after_window = (copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()))

    second = copy.deepcopy(model)
    second_optimizer = torch.optim.Adam(second.parameters(), lr=args.lr)
    second_optimizer.load_state_dict(after_window[1])
    again = window_estimates(second, second_optimizer, [next(train) for _ in range(args.window)])
    del second, second_optimizer

    interval = [next(train) for _ in range(args.interval)]
    required = [head[k] for k in order]
    target = costs.full / args.speedup
    masks: dict[str, list[bool]] = {}
    for name, values in estimates.items():
        decision = decide(costs, [float(values[k]) for k in order], target, required=required,
                          forbidden=[False] * len(order))
        masks[name] = [False] * len(names)
        for j, flag in enumerate(decision.mask.flags):
            masks[name][order[j]] = flag
    static = set(last_k_within_budget(prof, args.speedup, head=[HEAD + "*"]))
    masks["static_last_k"] = [n in static for n in names]
    masks["full"] = [True] * len(names)

    rows: dict[str, dict[str, float]] = {}
    for name, mask in masks.items():
        model.load_state_dict(after_window[0])
        optimizer.load_state_dict(after_window[1])
        train_steps(model, optimizer, interval, mask=mask)
        loss, accuracy = held_out(model, val)
        predicted = costs.predict([mask[k] for k in order]) / costs.full
        rows[name] = {"loss": loss, "accuracy": accuracy, "cost": predicted, "tensors": sum(mask)}
        if name in estimates:
            rows[name]["rho_oracle"] = spearman(estimates[name], estimates["oracle_window"])
            rows[name]["rho_numel"] = spearman(estimates[name], torch.tensor([float(p.numel()) for p in params]))
            if name in again:
                rows[name]["rho_next_window"] = spearman(estimates[name], again[name])
        print(f"  seed {seed} {name}: " + ", ".join(f"{k} {v:.4f}" for k, v in rows[name].items()), flush=True)
    return rows


def table(per_seed: list[dict[str, dict[str, float]]]) -> str:
    lines = [
        "| selection | step cost (of full) | tensors | held-out loss after the interval | vs static last-k "
        "| accuracy | rho with held-out truth | rho with element count | rho with the next window |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def cell(name: str, key: str, digits: int = 4) -> str:
        values = [rows[name][key] for rows in per_seed if key in rows[name]]
        if not values:
            return ""
        spread = f" ± {statistics.stdev(values):.{digits}f}" if len(values) > 1 else ""
        return f"{statistics.fmean(values):.{digits}f}{spread}"

    for name in per_seed[0]:
        diffs = [rows[name]["loss"] - rows["static_last_k"]["loss"] for rows in per_seed]
        diff = f"{statistics.fmean(diffs):+.4f}" + (f" ± {statistics.stdev(diffs):.4f}" if len(diffs) > 1 else "")
        lines.append(
            f"| {name} | {cell(name, 'cost', 2)} | {cell(name, 'tensors', 0)} | {cell(name, 'loss')} | {diff} "
            f"| {cell(name, 'accuracy', 3)} | {cell(name, 'rho_oracle', 2)} | {cell(name, 'rho_numel', 2)} "
            f"| {cell(name, 'rho_next_window', 2)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    per_seed = [one_seed(args, seed) for seed in args.seeds]
    print(table(per_seed))


if __name__ == "__main__":
    main()
