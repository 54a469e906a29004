"""The methods a benchmark compares, read from `cfg.benchmark` and checked up front, and each run's config.

Each run's method is its option of the `method/` config group (`conf/method/<kind>.yaml`), the one a single fit
gets from `recipes/train.py method=<kind>`; the benchmark's own settings of a method (`static_speedup`,
`backbone_unfreeze_epoch`, `freeze_start`, `freeze_level`) replace the option's fields of the same name.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from elastic_zoo.benchmark.readout import METRICS
from elastic_zoo.method import BackboneFinetuning, LinearFreeze, StaticLastK
from elastic_zoo.recipe import CONF_DIR

BASELINES: tuple[str, ...] = ("full", "head_only", "bitfit", "static_last_k", "backbone_finetuning", "linear_freeze")
# With `benchmark.full_again`, full fine-tuning runs a second time after each seed's other runs (see `methods_of`).
FULL_AGAIN = "full_again"


@dataclass(frozen=True)
class Method:
    """One way of fine-tuning: a baseline, or the elastic selection at a target speedup.

    An elastic run profiles into a cache folder of its own, empty before it (a first run on a machine); its
    `cached` twin runs after it with the profile that first run left there.
    """

    name: str
    kind: str
    speedup: float = math.nan
    cached: bool = False

    @property
    def profile_folder(self) -> str:
        """The cache folder name shared by an elastic run and its cached twin."""
        return self.name.removesuffix("_cached")


def methods_of(cfg: DictConfig) -> list[Method]:
    """The methods `cfg.benchmark` asks for, baselines first, then the elastic runs (and `full_again` last).

    Example:
        >>> methods_of(OmegaConf.create({"benchmark": {"baselines": ["full"], "elastic_speedups": [2]}}))
        [Method(name='full', kind='full', speedup=nan, cached=False), Method(name='elastic_2x', kind='elastic', \
speedup=2.0, cached=False)]
    """
    bench = cfg.benchmark
    methods = [Method(str(b), str(b)) for b in bench.baselines]
    methods += [Method(f"elastic_{float(s):g}x", "elastic", float(s)) for s in bench.elastic_speedups]
    cached = [float(s) for s in bench.get("elastic_cached_speedups", [])]
    methods += [Method(f"elastic_{s:g}x_cached", "elastic", s, cached=True) for s in cached]
    if bench.get("full_again", False):  # the same fit as `full`, last: the machine's drift between the seed's runs
        methods.append(Method(FULL_AGAIN, "full"))
    return methods


def benchmark_problems(cfg: DictConfig) -> list[str]:
    """What is wrong with `cfg.benchmark`, one message per problem.

    Example:
        >>> benchmark_problems(OmegaConf.create({"benchmark": {"seeds": [], "baselines": ["full"],
        ...     "elastic_speedups": [2.0], "static_speedup": 2.0, "backbone_unfreeze_epoch": 1,
        ...     "reference_speedup": 2.0, "accuracy_fraction": 0.99, "metric": "acc", "freeze_start": 0.5,
        ...     "freeze_level": 1.0}}))
        ['benchmark: `seeds` must be a non-empty list of distinct ints. Found: []']
    """
    bench = cfg.benchmark
    problems = []
    seeds = list(bench.seeds)
    if not seeds or not all(_is_int(s) for s in seeds) or len(set(seeds)) != len(seeds):
        problems.append(f"`seeds` must be a non-empty list of distinct ints. Found: {seeds}")
    unknown = [b for b in bench.baselines if b not in BASELINES]
    if unknown or len(set(bench.baselines)) != len(bench.baselines):
        problems.append(f"`baselines` must be distinct names among {BASELINES}. Found: {list(bench.baselines)}")
    speedups = list(bench.elastic_speedups)
    if not all(_is_number(s) and s > 1 for s in speedups) or len(set(speedups)) != len(speedups):
        problems.append(f"`elastic_speedups` must be distinct numbers > 1. Found: {speedups}")
    cached = list(bench.get("elastic_cached_speedups", []))
    if not set(cached) <= set(speedups) or len(set(cached)) != len(cached):
        problems.append(
            f"`elastic_cached_speedups` must be distinct speedups among `elastic_speedups` {speedups} (each reuses "
            f"the profile its first run left). Found: {cached}"
        )
    if not bench.baselines and not speedups:
        problems.append("`baselines` and `elastic_speedups` must name at least one method. Found: none")
    full_again = bench.get("full_again", False)
    if not isinstance(full_again, bool):
        problems.append(f"`full_again` must be true or false. Found: {full_again!r}")
    elif full_again and "full" not in bench.baselines:
        problems.append(
            "`full_again` true needs `full` among `baselines` (it runs full fine-tuning again after each seed's "
            f"other runs). Found: baselines {list(bench.baselines)}"
        )
    if not (_is_number(bench.reference_speedup) and bench.reference_speedup > 1):
        problems.append(f"`reference_speedup` must be a number > 1. Found: {bench.reference_speedup!r}")
    # The benchmark's settings of the baselines, checked by the methods they are handed to.
    checks: list[Callable[[], object]] = [
        lambda: StaticLastK("*", bench.static_speedup, "measured", "cpu"),
        lambda: BackboneFinetuning("*", bench.backbone_unfreeze_epoch),
        lambda: LinearFreeze("*", bench.freeze_start, bench.freeze_level),
    ]
    for check in checks:
        try:
            check()
        except ValueError as err:
            problems += str(err).split("; ")
    if not (_is_number(bench.accuracy_fraction) and 0 < bench.accuracy_fraction <= 1):
        problems.append(f"`accuracy_fraction` must be a number in (0, 1]. Found: {bench.accuracy_fraction!r}")
    if bench.metric not in METRICS:
        problems.append(f"`metric` must be one of {METRICS}. Found: {bench.metric!r}")
    return [f"benchmark: {p}" for p in problems]


def run_config(cfg: DictConfig, method: Method, seed: int) -> dict[str, Any]:
    """The resolved config of one run: `cfg` with the seed, the method's callback and its own TensorBoard folder.

    Resolved here, in the process that has Hydra's runtime settings, so the run can be handed to a fresh process.
    """
    run = OmegaConf.to_container(cfg, resolve=False)
    assert isinstance(run, dict)
    run_cfg = OmegaConf.create(run)
    run_cfg.seed = seed
    run_cfg.method = method_config(cfg, method.kind)
    if method.kind == "elastic":
        run_cfg.elastic.speedup = method.speedup
        # A first run profiles into an empty folder of its own; its cached twin finds the profile there.
        folder = Path(cfg.paths.output_dir) / "profiles" / f"{method.profile_folder}_seed_{seed}"
        run_cfg.elastic.cache_dir = str(folder)
    else:
        run_cfg.elastic._target_ = None  # no callback; its settings stay for the static selection's time model
    if run_cfg.logger.get("_target_") is not None:
        run_cfg.logger.name = method.name
        run_cfg.logger.version = f"seed_{seed}"
    # `${hydra:...}` only resolves while Hydra runs: fix the output folder before resolving.
    run_cfg.paths.output_dir = str(cfg.paths.output_dir)
    resolved = OmegaConf.to_container(run_cfg, resolve=True)
    assert isinstance(resolved, dict)
    return {str(key): value for key, value in resolved.items()}


def method_config(cfg: DictConfig, kind: str) -> DictConfig:
    """The `method/` group's option `kind`, with the fields `cfg.benchmark` sets for the benchmark's runs.

    Example:
        >>> method_config(OmegaConf.create({"benchmark": {"static_speedup": 1.5}}), "static_last_k").static_speedup
        1.5
    """
    option = OmegaConf.load(CONF_DIR / "method" / f"{kind}.yaml")
    assert isinstance(option, DictConfig)
    for key in option:
        if key in cfg.benchmark:
            option[key] = cfg.benchmark[key]
    return option


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
