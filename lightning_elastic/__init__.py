"""lightning-elastic: runtime elastic tensor selection for PyTorch Lightning.

`Trainer(callbacks=[ElasticTensorSelection(speedup=2.0)])` trains, at every moment, only the parameter tensors
that matter most under a per-step time budget. The pure parts can be used without a Trainer:
`profile` (per-tensor timing), `ImportanceEvaluator` (importance from real updates) and `select` (the exact DP).
"""

from lightning_elastic.callback import ElasticTensorSelection
from lightning_elastic.errors import ElasticConfigError, SpeedupOutOfReach
from lightning_elastic.importance import ImportanceEvaluator
from lightning_elastic.profiling import TimingProfile, profile
from lightning_elastic.selector import Selection, select

__all__ = [
    "ElasticConfigError",
    "ElasticTensorSelection",
    "ImportanceEvaluator",
    "Selection",
    "SpeedupOutOfReach",
    "TimingProfile",
    "profile",
    "select",
]
