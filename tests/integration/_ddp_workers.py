"""Plain-DDP scenarios run in 2 gloo processes by `test_ddp.py` (module level, so `torch.multiprocessing` can spawn them).

Each worker asserts; `torch.multiprocessing.spawn` re-raises a worker's failure in the test.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from lightning_elastic.distributed import register_selective_allreduce

WORLD_SIZE = 2
# Masks over the 8 tensors (w0, b0, ..., w3, b3): everything, scattered tensors (packed before sending), only the
# head (whole buckets skipped), earlier tensors unfrozen again, everything again.
MASKS = [
    (True,) * 8,
    (False, False, True, True, False, False, True, True),
    (False,) * 6 + (True, True),
    (True, True, False, False, True, False, False, True),
    (True,) * 8,
]


def init(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE, timeout=timedelta(seconds=60))


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2)
    )


def wrap(model: nn.Module, gradient_as_bucket_view: bool = False) -> DistributedDataParallel:
    # Small buckets, so that one bucket holds a few tensors and a model holds several buckets.
    return DistributedDataParallel(
        model,
        find_unused_parameters=True,
        bucket_cap_mb=1500 / 2**20,
        gradient_as_bucket_view=gradient_as_bucket_view,
    )


def batch(rank: int, step: int) -> Tensor:
    return torch.randn(5, 8, generator=torch.Generator().manual_seed(100 * step + rank))


def apply(model: nn.Module, mask: tuple[bool, ...]) -> None:
    for param, train in zip(model.parameters(), mask, strict=True):
        param.requires_grad_(train)
        if not train:
            param.grad = None


def same_on_every_rank(tensor: Tensor) -> bool:
    gathered = [torch.empty_like(tensor) for _ in range(WORLD_SIZE)]
    dist.all_gather(gathered, tensor.contiguous())
    return all(torch.equal(gathered[0], g) for g in gathered[1:])


def scenarios(rank: int, port: int) -> None:
    """Every scenario below in one process group: starting processes costs more than the scenarios."""
    init(rank, port)
    for gradient_as_bucket_view in (False, True):
        matches_default_allreduce(rank, gradient_as_bucket_view)
    profiling_backward_then_freeze(rank)
    mismatched_masks_raise(rank)
    unfrozen_after_wrap_raises(rank)
    dist.destroy_process_group()


def matches_default_allreduce(rank: int, gradient_as_bucket_view: bool) -> None:
    """Same gradients as DDP's own all-reduce, `grad=None` for frozen tensors, bytes = trained elements x 4."""
    reference, selective = wrap(mlp(), gradient_as_bucket_view), wrap(mlp(), gradient_as_bucket_view)
    state = register_selective_allreduce(selective)
    optimizers = [
        torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1) for m in (reference, selective)
    ]
    total = sum(p.numel() for p in selective.parameters())
    for step, mask in enumerate(MASKS):
        for model in (reference, selective):
            apply(model.module, mask)
            model(batch(rank, step)).square().mean().backward()
        for name, ref, sel, train in zip(
            [n for n, _ in selective.module.named_parameters()],
            reference.module.parameters(),
            selective.module.parameters(),
            mask,
            strict=True,
        ):
            if not train:
                assert ref.grad is None and sel.grad is None, f"step {step}: frozen {name} got a gradient"
                continue
            assert sel.grad is not None and ref.grad is not None
            assert torch.equal(ref.grad, sel.grad), f"step {step}: {name} gradient differs from DDP's own all-reduce"
            assert same_on_every_rank(sel.grad), f"step {step}: {name} gradient differs between ranks"
        trained = sum(p.numel() for p, m in zip(selective.parameters(), mask, strict=True) if m)
        assert state.last_step_bytes == 4 * trained, (step, state.last_step_bytes, trained)
        assert state.last_step_full_bytes == 4 * total
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    assert state.steps == len(MASKS)
    for ref, sel in zip(reference.parameters(), selective.parameters(), strict=True):
        assert torch.equal(ref, sel) and same_on_every_rank(sel)


def profiling_backward_then_freeze(rank: int) -> None:
    """A backward pass outside DDP's forward (the profiler's) marks tensors as used until the next synchronised
    step: a tensor frozen by then breaks DDP's reducer, unless `register_selective_allreduce` came after it."""
    for register in (False, True):
        model = wrap(mlp())
        with model.no_sync():
            model.module(batch(rank, 0)).sum().backward()
        apply(model.module, MASKS[2])
        if register:
            register_selective_allreduce(model)
        try:
            model(batch(rank, 1)).sum().backward()
        except RuntimeError as error:
            assert not register and "undefined, but still allreduced" in str(error), str(error)
        else:
            assert register, "DDP's reducer no longer trips over tensors marked used outside its forward"
            assert all((p.grad is None) != m for p, m in zip(model.parameters(), MASKS[2], strict=True))


def mismatched_masks_raise(rank: int) -> None:
    """A rank that trains other tensors than the others is stopped before anything is sent for them."""
    model = wrap(mlp())
    register_selective_allreduce(model)
    model(batch(rank, 0)).sum().backward()
    apply(model.module, MASKS[2] if rank == 0 else MASKS[1])
    try:
        model(batch(rank, 1)).sum().backward()
    except RuntimeError as error:
        assert "same tensors at the same step" in str(error), str(error)
    else:
        raise AssertionError("different masks on two ranks went through")


def unfrozen_after_wrap_raises(rank: int) -> None:
    """A tensor frozen when DDP wrapped the model must not train: DDP would never average its gradient."""
    net = mlp()
    net[0].weight.requires_grad_(False)
    model = wrap(net)
    register_selective_allreduce(model)
    model(batch(rank, 0)).sum().backward()
    net[0].weight.requires_grad_(True)
    try:
        model(batch(rank, 1)).sum().backward()
    except RuntimeError as error:
        assert "did not require grad when DDP wrapped" in str(error) and "0.weight" in str(error), str(error)
    else:
        raise AssertionError("a tensor outside DDP's buckets trained")
