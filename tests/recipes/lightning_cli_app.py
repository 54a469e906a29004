"""A LightningCLI program as a user writes one, for `test_lightning_cli.py`: a tiny model, its data, `LightningCLI`.

    python -m tests.recipes.lightning_cli_app fit --config elastic.yaml
    python -m tests.recipes.lightning_cli_app fit --trainer.callbacks+=ElasticTensorSelection \
        --trainer.callbacks.speedup=2.0

After the fit it prints one JSON line with what the callback did, for the test to read.
"""

from __future__ import annotations

import json
from typing import Any

from lightning.pytorch.cli import LightningCLI

from lightning_elastic import ElasticTensorSelection
from tests.integration.tiny import TinyNet, tiny_data


class TinyCLINet(TinyNet):
    """`TinyNet` with its own data, so that the command line needs no data module."""

    def train_dataloader(self) -> Any:
        return tiny_data(samples=64, batch_size=16)


if __name__ == "__main__":
    cli = LightningCLI(TinyCLINet)
    elastic = [c for c in cli.trainer.callbacks if isinstance(c, ElasticTensorSelection)]  # type: ignore[attr-defined]
    report = elastic[0].report() if elastic else None
    print(
        json.dumps(
            {
                "global_step": cli.trainer.global_step,
                "elastic_callbacks": len(elastic),
                "speedup": report.target_speedup if report else None,
                "selections": report.selections if report else None,
            }
        )
    )
