"""What the callback shows a person: the selection heatmap, importance, and the profile as a table.

Pure functions of plain data (numpy arrays and strings), so that loggers only have to write them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from lightning_elastic.profiler import TimingProfile

# Colours of the heatmap cells (RGB): trained, frozen, pinned to train, pinned frozen.
TRAINED = (46, 160, 67)
FROZEN = (30, 30, 30)
ALWAYS = (110, 200, 255)
NEVER = (120, 120, 120)


def selection_heatmap(
    history: Sequence[Sequence[bool]],
    required: Sequence[bool],
    forbidden: Sequence[bool],
    cell: int = 6,
) -> np.ndarray:
    """An RGB image (H, W, 3) of which tensors were trained at each selection.

    Rows are tensors in forward order (input at the top), columns are successive selections (left to right),
    each a `cell` x `cell` block: green trained, black frozen, light blue pinned to train, grey never trained.

    Example:
        >>> selection_heatmap([[True, False], [False, True]], [False, False], [False, False], cell=1)[:, :, 1]
        array([[160,  30],
               [ 30, 160]], dtype=uint8)
    """
    if not history:
        raise ValueError("`history` must hold at least one selection. Found: 0")
    masks = np.asarray(history, dtype=bool).T  # (tensors, selections)
    image = np.empty((*masks.shape, 3), dtype=np.uint8)
    image[masks] = TRAINED
    image[~masks] = FROZEN
    image[np.asarray(required, dtype=bool)] = ALWAYS
    image[np.asarray(forbidden, dtype=bool)] = NEVER
    return image.repeat(cell, axis=0).repeat(cell, axis=1)


def profile_table(profile: TimingProfile, selected: Sequence[bool] | None = None) -> str:
    """The per-tensor timing profile as a markdown table (milliseconds), with totals.

    Example:
        >>> p = TimingProfile(names=("a.weight",), t_dw=(0.002,), t_dy=(0.001,), t_fw=0.004, t_full=0.007,
        ...     device="cpu", fingerprint="f", unused=(), method="measured", numel=(9,))
        >>> print(profile_table(p).splitlines()[2])
        | 0 | a.weight | 9 | 2.000 | 1.000 |  |
    """
    lines = [
        "| # | tensor | elements | t_dw (ms) | t_dy (ms) | selected |",
        "|---|---|---|---|---|---|",
    ]
    for k, name in enumerate(profile.names):
        mark = "" if selected is None else ("yes" if selected[k] else "no")
        dw, dy = profile.t_dw[k] * 1e3, profile.t_dy[k] * 1e3
        lines.append(f"| {k} | {name} | {profile.numel[k]} | {dw:.3f} | {dy:.3f} | {mark} |")
    lines.append("")
    lines.append(
        f"device {profile.device}; method {profile.method}; forward {profile.t_fw * 1e3:.1f} ms; "
        f"fixed {profile.t_fixed * 1e3:.1f} ms; full forward+backward {profile.t_full * 1e3:.1f} ms; "
        f"unused parameters: {', '.join(profile.unused) or 'none'}"
    )
    return "\n".join(lines)
