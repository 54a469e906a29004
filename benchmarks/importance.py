"""Does the importance evaluator rank tensors by the loss drop their updates really bring?

EfficientNet-Lite0 with its ImageNet weights, fine-tuned on the real ELPV solar-cell images (4 classes,
112 px). Run from the repository root (one to two hours on two busy CPU cores; not a timing benchmark):

    PYTHONPATH=. flock -s /tmp/elastic-bench.lock .venv/bin/python benchmarks/importance.py --write

1. Warm-up in train mode: ``--head-steps`` steps of the new head alone, then ``--full-steps`` of the whole
   network (Adam), so the head is no longer random.
2. For each optimizer: a fresh optimizer takes ``--optimizer-steps`` steps on training batches (momentum and
   moments warm), then ``--batches`` measured steps on held-out (validation) batches, one after another.
   The model is in ``eval()`` mode from here on: BatchNorm uses its running statistics and dropout is off,
   so the loss is a deterministic function of the weights and the batch.
3. At each measured step on batch B, the evaluator's ``I_k`` with the before-gradient alone, the
   after-gradient alone (the ElasticTrainer reference), their average (after-gradient on B, and on the next
   batch as in training), and, as a baseline that ignores the update, ``|g_k|^2``. The truth is the loss
   drop of applying the real update to tensor k alone on B, ``L(w) - L(w + dw_k e_k)``, by brute force in
   float64; and the same drop on another batch of unseen (test) images, which no estimate has seen: the
   drop on B rewards fitting B's own noise. Reported: Spearman's rho between each estimate and each truth
   over the tensors, and the true loss drop on B of updating only the top ``--top`` fraction of tensors by
   each estimate (what a selection by that estimate keeps), next to that of the whole step.

Prints a markdown table and, with ``--write``, writes it with the date, the CPU and this command to
docs/importance.md (between the markers, leaving the rest of the page).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from scipy.stats import spearmanr
from torch import Tensor, nn

from elastic_zoo.data import ElpvDataModule
from elastic_zoo.models import efficientnet_lite0
from lightning_elastic.importance import ImportanceEvaluator, true_loss_drop

Batch = tuple[Tensor, Tensor]
VARIANTS = ("before", "after", "average", "average_next", "grad_norm")
LABELS = {
    "before": "before-gradient alone",
    "after": "after-gradient alone (reference)",
    "average": "average, after-gradient on the same batch",
    "average_next": "average, after-gradient on the next batch (as in training)",
    "grad_norm": "baseline: squared gradient norm",
    "truth": "oracle: the true single-tensor drops",
}
OPTIMIZERS: dict[str, Callable[[list[nn.Parameter], float], torch.optim.Optimizer]] = {
    "sgd": lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9),
    "adam": lambda params, lr: torch.optim.Adam(params, lr=lr),
    "adamw": lambda params, lr: torch.optim.AdamW(params, lr=lr, weight_decay=0.05),
}
DEFAULT_RUNS = ["sgd:1e-2", "sgd:1e-3", "adam:1e-4"]
DOC = Path(__file__).resolve().parent.parent / "docs" / "importance.md"
BEGIN, END = "<!-- bench_importance:begin -->", "<!-- bench_importance:end -->"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", default=DEFAULT_RUNS, help="optimizer:lr, optimizer in sgd|adam|adamw")
    parser.add_argument("--head-steps", type=int, default=100, help="warm-up steps of the head alone")
    parser.add_argument("--full-steps", type=int, default=150, help="warm-up steps of the whole network")
    parser.add_argument("--optimizer-steps", type=int, default=20, help="steps of each optimizer before measuring")
    parser.add_argument("--batches", type=int, default=4, help="measured steps (held-out batches) per optimizer")
    parser.add_argument(
        "--top", type=float, nargs="+", default=[0.1, 0.25, 0.5], help="fractions of tensors chosen by each estimate"
    )
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=112)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write every per-batch figure to this file")
    parser.add_argument("--write", action="store_true", help=f"write the table into {DOC}")
    args = parser.parse_args(argv)
    problems = []
    for run in args.runs:
        name, _, lr = run.partition(":")
        if name not in OPTIMIZERS or not _is_positive_float(lr):
            problems.append(
                f"`--runs` entries must be optimizer:lr with optimizer in {tuple(OPTIMIZERS)}. Found: {run}"
            )
    if not all(0 < f <= 1 for f in args.top):
        problems.append(f"`--top` must hold fractions in (0, 1]. Found: {args.top}")
    for name in ("head_steps", "full_steps", "optimizer_steps"):
        if getattr(args, name) < 0:
            problems.append(f"`--{name.replace('_', '-')}` must be a non-negative int. Found: {getattr(args, name)}")
    for name in ("batches", "batch_size", "image_size"):
        if getattr(args, name) < 1:
            problems.append(f"`--{name.replace('_', '-')}` must be a positive int. Found: {getattr(args, name)}")
    if problems:
        parser.error("; ".join(problems))
    return args


def _is_positive_float(text: str) -> bool:
    try:
        return float(text) > 0
    except ValueError:
        return False


def cycle(loader: torch.utils.data.DataLoader[Batch]) -> Iterator[Batch]:
    while True:
        yield from loader


def warm_up(model: nn.Module, batches: Iterator[Batch], head_steps: int, full_steps: int) -> None:
    """Train mode: the new head alone at lr 1e-3, then everything at lr 1e-4 (Adam)."""
    model.train()
    head = list(model._fc.parameters())  # type: ignore[union-attr]
    for params, lr, steps in ((head, 1e-3, head_steps), (list(model.parameters()), 1e-4, full_steps)):
        trainable = {id(p) for p in params}
        for p in model.parameters():
            p.requires_grad_(id(p) in trainable)
        optimizer = torch.optim.Adam(params, lr=lr)
        for step in range(steps):
            images, labels = next(batches)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
            if step % 25 == 0 or step == steps - 1:
                print(f"  warm-up lr {lr:g} step {step}: loss {loss.item():.3f}", flush=True)
    for p in model.parameters():
        p.requires_grad_(True)


def loss_of(model: nn.Module, batch: Batch) -> Tensor:
    images, labels = batch
    return F.cross_entropy(model(images.to(next(model.parameters()).dtype)), labels)


def gradients_at(model: nn.Module, batch: Batch) -> None:
    model.zero_grad(set_to_none=True)
    loss_of(model, batch).backward()


def measure_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    next_batch: Batch,
    unseen_batch: Batch,
    fractions: list[float],
) -> dict[str, float]:
    """One real optimizer step on `batch`; each estimate against the brute-force truth (see the docstring)."""
    params = list(model.parameters())
    reference = copy.deepcopy(model).double()  # the weights before the step, for the float64 truth
    evaluators = {
        "before": ImportanceEvaluator(params, gradient="before"),
        "after": ImportanceEvaluator(params, gradient="after"),
        "average": ImportanceEvaluator(params, gradient="average"),
        "average_next": ImportanceEvaluator(params, gradient="average"),
    }
    gradients_at(model, batch)
    grads = [p.grad for p in params]
    grad_norm = torch.tensor([float(g.double().square().sum()) for g in grads if g is not None], dtype=torch.float64)
    for evaluator in evaluators.values():
        evaluator.before_step()
    optimizer.step()
    for evaluator in evaluators.values():
        evaluator.after_step()
    gradients_at(model, batch)
    for name in ("after", "average"):
        evaluators[name].before_step()  # settles the update with the after-gradient on the same batch
    gradients_at(model, next_batch)
    evaluators["average_next"].before_step()  # as in training: the next step's gradient
    model.zero_grad(set_to_none=True)
    estimates = {}
    for name, evaluator in evaluators.items():
        evaluator.finish()
        estimates[name] = evaluator.importance
    estimates["grad_norm"] = grad_norm

    reference_params = list(reference.parameters())
    updates = [p.detach().double() - q.detach() for p, q in zip(params, reference_params, strict=True)]
    batch64 = (batch[0].double(), batch[1])
    unseen64 = (unseen_batch[0].double(), unseen_batch[1])

    def loss() -> Tensor:
        return loss_of(reference, batch64)

    truth = true_loss_drop(loss, reference_params, updates)
    truth_unseen = true_loss_drop(lambda: loss_of(reference, unseen64), reference_params, updates)
    result = {f"rho_{name}": spearman(estimates[name], truth) for name in VARIANTS}
    result |= {f"rho_unseen_{name}": spearman(estimates[name], truth_unseen) for name in VARIANTS}

    def drop_of(selected: Tensor) -> float:
        """True loss drop of updating the `selected` tensors alone."""
        with torch.no_grad():
            saved = [p.clone() for p in reference_params]
            base = float(loss())
            for k in selected.tolist():
                reference_params[k].add_(updates[k])
            drop = base - float(loss())
            for p, w in zip(reference_params, saved, strict=True):
                p.copy_(w)
        return drop

    with torch.no_grad():
        result["loss"] = float(loss())
    result["step_drop"] = drop_of(torch.arange(len(params)))
    result["sum_of_single_drops"] = float(truth.sum())
    for fraction in fractions:
        count = max(1, round(fraction * len(params)))
        for name, values in [*estimates.items(), ("truth", truth)]:
            result[f"top{fraction:g}_{name}"] = drop_of(values.topk(count).indices)
    return result


def spearman(x: Tensor, y: Tensor) -> float:
    return float(spearmanr(x.numpy(), y.numpy()).statistic)


def run(args: argparse.Namespace) -> tuple[list[dict[str, object]], str]:
    torch.manual_seed(args.seed)
    data = ElpvDataModule(image_size=args.image_size, batch_size=args.batch_size, seed=args.seed)
    data.setup()
    train_batches = cycle(data.train_dataloader())
    held_out = list(data.val_dataloader())
    unseen = list(data.test_dataloader())
    most = min(len(held_out) - 1, len(unseen))
    if args.batches > most:
        raise SystemExit(f"`--batches` must be at most {most} (held-out batches). Found: {args.batches}")
    model = efficientnet_lite0(num_classes=data.num_classes)
    started = time.perf_counter()
    print(f"Warm-up: {args.head_steps} head steps, {args.full_steps} full steps", flush=True)
    warm_up(model, train_batches, args.head_steps, args.full_steps)
    warm_state = copy.deepcopy(model.state_dict())
    model.eval()
    with torch.no_grad():
        val_loss = statistics.fmean(float(loss_of(model, b)) for b in held_out)
    print(f"  held-out loss after warm-up: {val_loss:.3f} ({time.perf_counter() - started:.0f} s)", flush=True)

    rows: list[dict[str, object]] = []
    for run_spec in args.runs:
        name, _, lr_text = run_spec.partition(":")
        model.load_state_dict(warm_state)
        model.eval()
        optimizer = OPTIMIZERS[name](list(model.parameters()), float(lr_text))
        for _ in range(args.optimizer_steps):
            gradients_at(model, next(train_batches))
            optimizer.step()
        per_batch = []
        for j in range(args.batches):
            result = measure_step(model, optimizer, held_out[j], held_out[j + 1], unseen[j], args.top)
            per_batch.append(result)
            print(f"  {run_spec} batch {j}: " + ", ".join(f"{k} {v:.3f}" for k, v in result.items()), flush=True)
        rows.append({"run": run_spec, "batches": per_batch})
    header = (
        f"{len(list(model.parameters()))} tensors, batch {args.batch_size} at {args.image_size} px, "
        f"held-out loss after warm-up {val_loss:.3f}"
    )
    return rows, header


def table(rows: list[dict[str, object]], fractions: list[float]) -> str:
    top_headers = "".join(f" top {f:.0%} |" for f in fractions)
    lines = [
        "| optimizer | estimate | rho, same batch: mean | min | rho, unseen batch: mean | min |" + top_headers,
        "|---|---|---:|---:|---:|---:|" + "---:|" * len(fractions),
    ]
    for row in rows:
        batches: list[dict[str, float]] = row["batches"]  # type: ignore[assignment]
        for name in (*VARIANTS, "truth"):
            cells = []
            for key in ("rho", "rho_unseen"):
                rho = [b[f"{key}_{name}"] for b in batches] if name != "truth" else []
                cells.append(f"{statistics.fmean(rho):.3f} | {min(rho):.3f}" if rho else " | ")
            tops = "".join(f" {statistics.fmean(b[f'top{f:g}_{name}'] for b in batches):.4f} |" for f in fractions)
            lines.append(f"| {row['run']} | {LABELS[name]} | {' | '.join(cells)} |" + tops)
        whole = statistics.fmean(b["step_drop"] for b in batches)
        loss = statistics.fmean(b["loss"] for b in batches)
        lines.append(
            f"| {row['run']} | the whole step (loss before it: {loss:.3f}) | | | | |"
            + f" {whole:.4f} |" * len(fractions)
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    rows, header = run(args)
    text = table(rows, args.top)
    print(header)
    print(text)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.write:
        command = "PYTHONPATH=. flock -s /tmp/elastic-bench.lock .venv/bin/python benchmarks/importance.py"
        if argv:
            command += " " + shlex.join(argv)
        block = "\n".join(
            [
                BEGIN,
                f"- Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
                f"- Machine: {platform.processor() or platform.machine()}, Python {platform.python_version()}, "
                f"torch {torch.__version__}",
                f"- Command: `{command}`",
                f"- Setup: {header}",
                "",
                text,
                END,
            ]
        )
        page = DOC.read_text() if DOC.exists() else ""
        if BEGIN in page and END in page:
            page = page[: page.index(BEGIN)] + block + page[page.index(END) + len(END) :]
        else:
            page = page + ("\n" if page else "") + block + "\n"
        DOC.write_text(page)


if __name__ == "__main__":
    main()
