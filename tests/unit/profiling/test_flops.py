"""The analytic FLOPs costs."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from lightning_elastic.profiling import TimingProfile, profile


def test_flops_method_orders_layers_by_size_and_round_trips() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 4))
    x = torch.randn(512, 64)
    prof = profile(net, lambda: net(x).square().mean(), method="flops", repeats=1)
    assert prof.method == "flops"
    dw = dict(zip(prof.names, prof.t_dw, strict=True))
    dy = dict(zip(prof.names, prof.t_dy, strict=True))
    assert dw["2.weight"] > 4 * dw["0.weight"]
    assert dy["2.weight"] > dy["4.weight"] > 0  # 64->1024 propagates more than 1024->4
    assert prof.predict([True] * len(prof.names)) == pytest.approx(prof.t_full, rel=1e-6)
    assert TimingProfile.from_dict(json.loads(json.dumps(prof.to_dict()))) == prof
