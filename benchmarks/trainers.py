"""The quiet Trainer of the benchmarks that time or weigh a fit: training only, nothing written, nothing printed.

No validation, sanity check, logger, checkpoint, progress bar or model summary: their work would fall inside the
figures (step times, memory high-water marks). Each script adds what it measures (callbacks, epochs, batches).
"""

from __future__ import annotations

from typing import Any

import lightning as L


def quiet_trainer(callbacks: list[L.Callback], **kwargs: Any) -> L.Trainer:
    """An `L.Trainer` that only trains, with `callbacks` and what the script measures in `kwargs` (epochs, batches)."""
    return L.Trainer(
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        **kwargs,
    )
