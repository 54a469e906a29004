"""ElasticTensorSelection under DDP on CPU: 2 gloo processes against one process on the same global batch.

The strategy checks run in this process. The rest starts processes: `_ddp_workers.scenarios` (plain DDP, the
communication hook against DDP's own all-reduce), and `ddp_fit.py` under `strategy="ddp"` (a fit with several
selections, compared step by step with the same fit on one process) and under `strategy="ddp_spawn"` (resumed
with `ckpt_path` from the first fit's checkpoint, compared with the uninterrupted fit).
"""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
    Strategy,
    XLAStrategy,
)

from lightning_elastic.distributed import install_selective_allreduce, prepare_strategy
from tests.integration import _ddp_models, _ddp_workers

ROOT = Path(__file__).resolve().parents[2]
WORLD_SIZE = 2
# One process and two see the same global batches; they differ by the order of floating-point sums (the loss is
# a mean over two half-batches, gradients are averaged by an all-reduce), a few ulps per step.
RTOL, ATOL = 1e-5, 1e-6


# ---------------------------------------------------------------------- strategy checks, in this process


def test_ddp_is_given_find_unused_parameters(caplog: pytest.LogCaptureFixture) -> None:
    strategy = DDPStrategy()
    with caplog.at_level("INFO"):
        prepare_strategy(strategy)
    assert strategy._ddp_kwargs == {"find_unused_parameters": True}
    assert "set `find_unused_parameters=True`" in caplog.text
    kept = DDPStrategy(find_unused_parameters=True, gradient_as_bucket_view=True)
    prepare_strategy(kept)
    assert kept._ddp_kwargs == {"find_unused_parameters": True, "gradient_as_bucket_view": True}


def test_ddp_settings_that_cannot_work_are_refused_together() -> None:
    with pytest.raises(ValueError) as error:
        prepare_strategy(DDPStrategy(find_unused_parameters=False, static_graph=True))
    assert "`static_graph` must be False" in str(error.value)
    assert "`find_unused_parameters` must be True" in str(error.value)
    assert str(error.value).endswith("Found: find_unused_parameters=False")


def test_users_comm_hook_is_left_in_place_with_a_warning() -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    with pytest.warns(UserWarning, match="gradients of frozen tensors .* are still sent"):
        prepare_strategy(DDPStrategy(ddp_comm_hook=allreduce_hook))


@pytest.mark.parametrize("strategy", [FSDPStrategy, DeepSpeedStrategy, ModelParallelStrategy, XLAStrategy])
def test_sharded_strategies_are_refused_with_what_to_use(strategy: type[Strategy]) -> None:
    # Only the type matters; DeepSpeed and XLA cannot be constructed without their packages.
    with pytest.raises(ValueError, match=rf"supports single-device strategies and DDP .* Found: {strategy.__name__}"):
        prepare_strategy(object.__new__(strategy))


def test_one_device_needs_nothing() -> None:
    strategy = SingleDeviceStrategy("cpu")
    prepare_strategy(strategy)
    assert install_selective_allreduce(strategy) is None


# ---------------------------------------------------------------------- plain DDP, 2 processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
@pytest.mark.distributed
def test_selective_allreduce_with_plain_ddp() -> None:
    """Against DDP's own all-reduce; after a profiling pass; refusing different masks and unsynchronised tensors."""
    # Forked: the processes start with torch already imported (CPU only, so forking is safe).
    mp.start_processes(_ddp_workers.scenarios, args=(_free_port(),), nprocs=WORLD_SIZE, start_method="fork")


# ---------------------------------------------------------------------- Lightning fits


def _run(out: Path, *args: str) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "tests.integration.ddp_fit", "--out", str(out), *args]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


def _load(out: Path, ranks: int) -> list[dict[str, Any]]:
    return [torch.load(out.with_name(f"{out.name}_rank{r}.pt")) for r in range(ranks)]


@pytest.fixture(scope="module")
def fits(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """One process; 2 processes under "ddp" with a checkpoint per epoch; "ddp_spawn" resumed after epoch 0."""
    tmp = tmp_path_factory.mktemp("ddp")
    _ddp_models.fit(tmp / "single")
    _run(tmp / "ddp", "--strategy", "ddp", "--devices", "2", "--checkpoint-dir", str(tmp / "checkpoints"))
    checkpoint = tmp / "checkpoints" / f"epoch=0-step={_ddp_models.STEPS_PER_EPOCH}.ckpt"
    _run(tmp / "resumed", "--strategy", "ddp_spawn", "--devices", "2", "--ckpt-path", str(checkpoint))
    return {
        "single": _load(tmp / "single", 1),
        "ddp": _load(tmp / "ddp", WORLD_SIZE),
        "resumed": _load(tmp / "resumed", WORLD_SIZE),
    }


@pytest.mark.slow
@pytest.mark.distributed
def test_ranks_agree_and_follow_the_single_process_run(fits: dict[str, list[dict[str, Any]]]) -> None:
    (single,), ranks = fits["single"], fits["ddp"]
    steps = _ddp_models.MAX_EPOCHS * _ddp_models.STEPS_PER_EPOCH
    for rank in ranks:
        assert rank["steps"] == single["steps"] == list(range(steps))
        assert rank["masks"] == single["masks"], "a rank trained other tensors than the single process"
        assert rank["selections"] == single["selections"]
        assert rank["moved_while_frozen"] == [], "a frozen tensor changed"
    for a, b in zip(ranks[0]["params"], ranks[1]["params"], strict=True):
        assert torch.equal(a, b), "the ranks ended with different parameters"
    ddp_loss = torch.tensor([r["losses"] for r in ranks]).mean(dim=0)
    torch.testing.assert_close(ddp_loss, torch.tensor(single["losses"]), rtol=RTOL, atol=ATOL)
    for a, b in zip(ranks[0]["params"], single["params"], strict=True):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


@pytest.mark.slow
@pytest.mark.distributed
def test_selections_freeze_and_unfreeze_tensors(fits: dict[str, list[dict[str, Any]]]) -> None:
    selections = [[c == "1" for c in mask] for mask in fits["ddp"][0]["selections"]]
    changes = [list(zip(s, t, strict=True)) for s, t in itertools.pairwise(selections)]
    frozen = any(a and not b for change in changes for a, b in change)
    unfrozen = any(b and not a for change in changes for a, b in change)
    assert frozen and unfrozen, selections
    assert not all(all(m) for m in fits["ddp"][0]["masks"])


@pytest.mark.slow
@pytest.mark.distributed
def test_only_trained_gradients_are_sent(fits: dict[str, list[dict[str, Any]]]) -> None:
    for rank in fits["ddp"] + fits["resumed"]:
        numel = rank["numel"]
        assert len(rank["sent"]) == len(rank["masks"])
        for mask, sent, full in zip(rank["masks"], rank["sent"], rank["full"], strict=True):
            assert sent == 4 * sum(n for n, m in zip(numel, mask, strict=True) if m)
            assert full == 4 * sum(numel)
    assert min(fits["ddp"][0]["sent"]) < max(fits["ddp"][0]["sent"])


@pytest.mark.slow
@pytest.mark.distributed
def test_resumed_under_ddp_spawn_continues_the_same_fit(fits: dict[str, list[dict[str, Any]]]) -> None:
    """The checkpoint's mask is applied after DDP wraps the model and trains from the first resumed step."""
    uninterrupted, resumed = fits["ddp"], fits["resumed"]
    start = _ddp_models.STEPS_PER_EPOCH
    for before, after in zip(uninterrupted, resumed, strict=True):
        assert after["steps"] == before["steps"][start:]
        assert after["masks"] == before["masks"][start:]
        assert not all(after["masks"][0]), "the checkpoint should hold a selection, not a probe window"
        torch.testing.assert_close(torch.tensor(after["losses"]), torch.tensor(before["losses"][start:]))
        for a, b in zip(after["params"], before["params"], strict=True):
            torch.testing.assert_close(a, b)
