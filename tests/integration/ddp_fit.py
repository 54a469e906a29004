"""Run `_ddp_models.fit` from the command line: `strategy="ddp"` re-launches this script once per extra process.

python -m tests.integration.ddp_fit --out /tmp/run --strategy ddp --devices 2
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tests.integration._ddp_models import fit

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True, help="records go to OUT_rank<r>.pt")
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--ckpt-path", default=None, help="resume from this checkpoint")
    parser.add_argument("--checkpoint-dir", type=Path, default=None, help="save a checkpoint every epoch here")
    args = parser.parse_args()
    fit(args.out, args.strategy, args.devices, args.ckpt_path, args.checkpoint_dir)
