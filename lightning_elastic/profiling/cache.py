"""The per-user cache of timing profiles: where it is (`resolve_cache_dir`), how an entry is keyed (`cache_key`, a
fingerprint of the device, torch, the parameters and the step) and found (`cache_file`, `load_cached`), and the steady
step a fit adds to its entry (`remember_step`). Entries are read and written by `profile.read_profile` and `store`."""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import warnings
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from lightning_elastic.errors import ElasticConfigError
from lightning_elastic.profiling.profile import FORMAT_VERSION, StaleProfileError, TimingProfile, read_profile, store

__all__ = ["cache_file", "cache_key", "device_name", "load_cached", "remember_step", "resolve_cache_dir"]

CACHE_ENV = "LIGHTNING_ELASTIC_CACHE_DIR"


def device_name(device: torch.device) -> str:
    """The device a profile is taken on, as profiles, cache keys and fits that reuse a profile name and compare it:
    the kind of device and its model (for a CPU, the threads torch uses), not which of several alike GPUs it was, so
    that a profile taken on one serves the others.

    Example:
        >>> device_name(torch.device("cpu")) == device_name(torch.device("cpu", 1))
        True
    """
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda ({torch.cuda.get_device_name(index)})"
    if device.type == "cpu":
        return f"cpu ({torch.get_num_threads()} threads, {platform.processor() or platform.machine()})"
    return str(device)


# The pass plan each method measures its profile with: a plan of its own keys its own entries, so that a profile taken
# the earlier way is measured again, once. "measured" 2: its hook times scaled to one plain full step, no longer
# rescaled at five selections (2026-12-07, docs/time_model.md).
PLANS = {"measured": 2, "flops": 1}


def cache_key(
    signature: Mapping[str, Any], device: torch.device, candidates: list[tuple[str, nn.Parameter]], method: str
) -> str:
    payload = {
        "version": FORMAT_VERSION,
        "device": device_name(device),
        "torch": torch.__version__,
        "method": method,
        "plan": PLANS.get(method, 1),
        "params": [[name, list(p.shape), str(p.dtype)] for name, p in candidates],
        "signature": dict(signature),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def load_cached(path: Path, fingerprint: str, quiet: bool = False) -> TimingProfile | None:
    """The cached profile at ``path`` if it is current; else None, with a warning for a bad file (unless `quiet`:
    a profile only looked for, which this run will not measure again)."""
    if not path.exists():
        return None
    if quiet:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return load_cached(path, fingerprint)
    try:
        prof = read_profile(path)
    except StaleProfileError as err:
        warnings.warn(f"Timing profile cache {path} is stale ({err}); measuring again.", stacklevel=3)
        return None
    except (OSError, ValueError) as err:
        warnings.warn(f"Timing profile cache {path} is corrupt ({err}); measuring again.", stacklevel=3)
        return None
    if prof.fingerprint != fingerprint:
        warnings.warn(
            f"Timing profile cache {path} does not match this model, device and input (fingerprint "
            f"{prof.fingerprint[:12]}..., expected {fingerprint[:12]}...); measuring again.",
            stacklevel=3,
        )
        return None
    return prof


def cache_file(cache_dir: Path, fingerprint: str) -> Path:
    """Where the cache keeps the profile of `fingerprint`.

    Example:
        >>> cache_file(Path("/cache"), "0123456789abcdef0123456789abcdef").name
        'timing-0123456789abcdef01234567.json'
    """
    return cache_dir / f"timing-{fingerprint[:24]}.json"


def remember_step(cache_dir: Path | None, prof: TimingProfile, seconds: float, update: float = 0.0) -> None:
    """Keep `seconds`, a steady full training step measured with `prof`, as `t_step` in the cache's entry of the
    same fingerprint, and `update`, its optimizer update, as `t_update` (0, not known, unless less than the step):
    only an entry there already (a profile given by the user or a checkpoint enters no cache), its timings as they
    were. An entry that cannot be read or written is left as it is, with a warning: the fit goes on.
    """
    if cache_dir is None or not 0 < seconds < math.inf:
        return
    update = update if 0 <= update < seconds else 0.0
    path = cache_file(cache_dir, prof.fingerprint)
    try:
        if not path.exists() or (cached := read_profile(path)).fingerprint != prof.fingerprint:
            return
        store(path, replace(cached, t_step=seconds, t_update=update))
    except (OSError, ValueError) as err:  # a stale format is a ValueError too
        warnings.warn(
            f"Timing profile cache {path} could not keep this fit's steady full step ({err}); a later process with "
            "this profile warms up against the profile's own full step.",
            stacklevel=2,
        )


def resolve_cache_dir(cache_dir: str | os.PathLike[str] | Literal[False] | None) -> Path | None:
    """The directory of cached profiles: the given one, the per-user one for None, none for False.

    Raises:
        ElasticConfigError: when the directory is an existing file.
    """
    if cache_dir is False:
        return None
    if cache_dir is None:
        base = os.environ.get(CACHE_ENV) or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "lightning-elastic"
        )
        path = Path(base)
    else:
        path = Path(cache_dir)
    if path.exists() and not path.is_dir():
        raise ElasticConfigError(
            f"`cache_dir` must be a directory (or None for the user cache, False for none). Found: a file {str(path)!r}"
        )
    return path
