"""What the callback shows a person: the selection map and the profile as a table.

Pure functions of plain data (records, names, numpy arrays), so that loggers and recipes only have to write them.
The selection map is drawn with Pillow (TensorBoard's own PNG encoder), never with a plotting library.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from lightning_elastic.profiling import TimingProfile
from lightning_elastic.records import SelectionRecord


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


# The selection map: the state of a tensor at a selection, its colour and its legend entry, in this order.
MAP_STATES: tuple[tuple[str, tuple[int, int, int]], ...] = (
    ("trained", (46, 160, 67)),
    ("frozen, gradient passes through", (196, 200, 206)),
    ("frozen prefix (no backward)", (62, 66, 80)),
    ("pinned: always trained", (86, 156, 230)),
    ("never trainable", (226, 168, 108)),
)
MAX_ROWS = 64  # beyond this many tensors, rows are modules (consecutive tensors that share a name prefix)
MAX_COLUMNS = 120  # beyond this many selections, evenly spaced ones are shown
ROW = 14  # pixels of a row: one line of the default font
_INK, _PAPER, _RULE = (20, 20, 20), (255, 255, 255), (150, 150, 150)
Font = ImageFont.FreeTypeFont | ImageFont.ImageFont  # what `ImageFont.load_default` returns


# The selection maps drawn during a fit take at most this share of its training time so far: drawing and encoding
# one took 157 ms on this 2-core CPU (64 rows, Lite0's 152 tensors), and drawn at every selection, the maps were
# 1.0% of ELPV's 150-step fit at 2x and 2.4% of a 200-step few-shot fit at 3x (2026-12-06, docs/results.md).
MAP_SHARE = 0.005
MAP_SECONDS = 0.15  # what a map is taken to cost until this fit has timed one (about what 64 rows take on a CPU)


@dataclass
class MapPace:
    """When the selection map is drawn during a fit: at a selection when the maps drawn so far and the next one,
    at what the last one cost, stay within `MAP_SHARE` of the fit's training time so far (a long fit's every
    selection, a short fit's few), and as the fit ends when selections came after the last map (`stale`).

    Example:
        >>> pace = MapPace()
        >>> pace.due(spent=20.0), pace.due(spent=31.0)  # 0.15 s is 0.5% of 30 s
        (False, True)
        >>> pace.drew(seconds=0.1, selections=3)
        >>> pace.due(spent=35.0), pace.due(spent=45.0), pace.stale(3), pace.stale(4)
        (False, True, False, True)
    """

    seconds: float = 0.0  # what the maps drawn so far took
    cost: float = MAP_SECONDS  # what the next is taken to cost: the last one's time
    shown: int = 0  # the selections the last map showed

    def due(self, spent: float) -> bool:
        """Whether a map drawn now keeps the maps within their share of `spent` seconds of training."""
        return self.seconds + self.cost <= MAP_SHARE * spent

    def drew(self, seconds: float, selections: int) -> None:
        """A map of `selections` selections was drawn and written in `seconds`."""
        self.seconds, self.cost, self.shown = self.seconds + seconds, seconds, selections

    def stale(self, selections: int) -> bool:
        """Whether the last map left out some of `selections`."""
        return selections > self.shown


def selection_states(
    records: Sequence[SelectionRecord], required: Sequence[bool], forbidden: Sequence[bool]
) -> np.ndarray:
    """The index into `MAP_STATES` of every tensor (rows, forward order) at every selection (columns).

    A frozen tensor before the deepest trained one is in the frozen prefix: backward stops before reaching it.

    Example:
        >>> from lightning_elastic.records import Decision, Mask
        >>> rec = SelectionRecord(0, 0, Decision(Mask.of([False, True, False, False]), (0.0,) * 4, 0.1, 0.1), 0.2)
        >>> selection_states([rec], [False] * 4, [False, False, False, True])[:, 0].tolist()
        [2, 0, 1, 4]
    """
    masks = np.array([r.mask.flags for r in records], dtype=bool).T  # (tensors, selections)
    rows = np.arange(masks.shape[0])[:, None]
    deepest = np.array([masks.shape[0] if r.mask.deepest is None else r.mask.deepest for r in records])
    states = np.where(masks, 0, np.where(rows < deepest[None, :], 2, 1))
    states[np.asarray(required, dtype=bool)] = 3
    states[np.asarray(forbidden, dtype=bool)] = 4
    return states


def module_rows(
    names: Sequence[str], max_rows: int = MAX_ROWS, numel: Sequence[int] | None = None
) -> list[tuple[str, int, int]]:
    """Rows of the map as (label, first tensor, end): one per tensor, or per module when there are too many.

    Modules are runs of consecutive tensors sharing a dotted name prefix. Rows start as top-level modules; the
    largest row (by `numel`, else by tensors) is split into its sub-modules, again and again, while the rows stay
    at most `max_rows`: where most parameters are, the map shows layers; small blocks stay whole. When even
    top-level modules are too many, rows are equal runs of tensors. The prefix every name shares is left out of
    the labels but for its last part (`model.layers.3.w` reads `layers.3.w`).

    Example:
        >>> module_rows(["m.a.0.w", "m.a.0.b", "m.a.1.w", "m.head.w"], max_rows=3)
        [('a.0.* (2)', 0, 2), ('a.1.w', 2, 3), ('head.w', 3, 4)]
        >>> module_rows(["m.a.0.w", "m.a.0.b", "m.a.1.w"], max_rows=2)
        [('a.0.* (2)', 0, 2), ('a.1.w', 2, 3)]
    """
    parts = [n.split(".") for n in names]
    shared = 0
    while parts and all(len(p) > shared + 1 and p[shared] == parts[0][shared] for p in parts):
        shared += 1
    parts = [p[shared - 1 if shared > 1 else shared :] for p in parts]  # keep the last shared part: `layers.3`

    def runs(start: int, end: int, depth: int) -> list[tuple[int, int, int]]:
        keys = [tuple(parts[k][:depth]) for k in range(start, end)]
        cuts = [k for k in range(len(keys)) if k == 0 or keys[k] != keys[k - 1]]
        return [(depth, start + a, start + b) for a, b in zip(cuts, [*cuts[1:], len(keys)], strict=True)]

    cumulative = np.concatenate([[0], np.cumsum(numel if numel is not None else np.ones(len(parts)))])
    rows = runs(0, len(parts), 1)
    if len(rows) > max_rows:
        size = math.ceil(len(names) / max_rows)
        return [(f"{'.'.join(parts[a])} ..", a, min(a + size, len(names))) for a in range(0, len(names), size)]
    split = True
    while split:
        split = False
        for i in sorted(range(len(rows)), key=lambda i: cumulative[rows[i][1]] - cumulative[rows[i][2]]):
            depth, a, b = rows[i]
            finer = next((r for d in range(depth + 1, len(parts[a]) + 1) if len(r := runs(a, b, d)) > 1), [])
            if finer and len(rows) - 1 + len(finer) <= max_rows:
                rows[i : i + 1] = finer
                split = True
                break
    return [
        (".".join(parts[a]) if b - a == 1 else f"{'.'.join(parts[a][:d])}.* ({b - a})", a, b) for d, a, b in rows
    ]


def selection_map(
    records: Sequence[SelectionRecord],
    names: Sequence[str],
    numel: Sequence[int],
    required: Sequence[bool],
    forbidden: Sequence[bool],
    axis: Literal["epoch", "step"] = "epoch",
) -> np.ndarray:
    """The selection map as an RGB image (H, W, 3): what was trained, and when.

    Rows are tensors in model order (input at the top), grouped by module beyond `MAX_ROWS` tensors, with their
    names on the left and parameter counts on the right; columns are successive selections, labelled with the
    epoch or step they came into force. A module's cell blends its tensors' colours by parameter count. Colours
    and their meaning are in the legend under the map (`MAP_STATES`).
    """
    if not records:
        raise ValueError("`records` must hold at least one selection. Found: 0")
    shown = np.unique(np.linspace(0, len(records) - 1, min(len(records), MAX_COLUMNS)).round().astype(int))
    records = [records[k] for k in shown]
    rows = module_rows(names, numel=numel)
    weights = np.maximum(np.asarray(numel, dtype=np.float64), 1.0)
    palette = np.array([colour for _, colour in MAP_STATES], dtype=np.float64)
    colours = palette[selection_states(records, required, forbidden)] * weights[:, None, None]
    starts = np.array([a for _, a, _ in rows])
    cells = np.add.reduceat(colours, starts, axis=0) / np.add.reduceat(weights, starts)[:, None, None]

    font = ImageFont.load_default(size=11)
    labels = [label for label, _, _ in rows]
    counts = [_count(int(sum(numel[a:b]))) for _, a, b in rows]
    label_w = min(260, int(max(font.getlength(t) for t in labels)) + 8)
    count_w = int(max(font.getlength(t) for t in [*counts, "params"])) + 8
    cell_w = max(6, min(40, 600 // len(records)))
    left, top = 8 + label_w, 8 + 3 * ROW
    grid_w, grid_h = cell_w * len(records), ROW * len(rows)
    width = max(left + grid_w + 8 + count_w + 8, 560)
    legend_lines = _legend_lines(font, width - 16)
    height = top + grid_h + 8 + ROW * (1 + len(legend_lines))
    image = Image.new("RGB", (width, height), _PAPER)
    grid = cells.round().astype(np.uint8).repeat(ROW, axis=0).repeat(cell_w, axis=1)
    grid[ROW - 1 :: ROW] = _PAPER  # a one-pixel gap between rows
    image.paste(Image.fromarray(grid, "RGB"), (left, top))
    draw = ImageDraw.Draw(image)

    title = f"Selection map: {len(names)} tensors"
    title += f" in {len(rows)} modules" if len(rows) < len(names) else ""
    title += f", {len(shown)} of {shown[-1] + 1} selections"
    draw.text((8, 6), title + " (model order, input at the top)", fill=_INK, font=font)
    values = [r.epoch if axis == "epoch" else r.step for r in records]
    every = max(1, math.ceil((font.getlength(str(max(values))) + 6) / cell_w))
    draw.text((8, 6 + 1.5 * ROW), f"{axis} ->", fill=_INK, font=font)
    for k in range(0, len(records), every):
        draw.text((left + k * cell_w + 1, 6 + 1.5 * ROW), str(values[k]), fill=_INK, font=font)
    draw.text((left + grid_w + 8, 6 + 1.5 * ROW), "params", fill=_INK, font=font)
    parents = [_parent(label) for label in labels]
    for r, (label, count) in enumerate(zip(labels, counts, strict=True)):
        y = top + r * ROW
        if r and not _nested(parents[r], parents[r - 1]):  # a rule between layers
            draw.line((8, y - 1, width - 8, y - 1), fill=_RULE)
        draw.text((8, y), _fit(font, label, label_w - 8), fill=_INK, font=font)
        draw.text((left + grid_w + 8, y), count, fill=_INK, font=font)
    y = top + grid_h + 8
    for line in legend_lines:
        x = 8
        for name, colour in line:
            draw.rectangle((x, y + 2, x + 9, y + 11), fill=colour, outline=_INK)
            draw.text((x + 14, y), name, fill=_INK, font=font)
            x += 14 + int(font.getlength(name)) + 16
        y += ROW
    return np.asarray(image, dtype=np.uint8)


def _parent(label: str) -> str:
    """The module that holds a row's module: `layers.0` for `layers.0.attn.weight` and for `layers.0.attn.* (4)`."""
    module = label.rsplit(".*", 1)[0] if label.endswith(")") else label.rsplit(".", 1)[0]
    return module.rsplit(".", 1)[0]


def _nested(a: str, b: str) -> bool:
    """Whether module `a` holds `b` or `b` holds `a` (dotted names)."""
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def _legend_lines(font: Font, width: int) -> list[list[tuple[str, tuple[int, int, int]]]]:
    lines: list[list[tuple[str, tuple[int, int, int]]]] = [[]]
    x = 0
    for name, colour in MAP_STATES:
        w = 14 + int(font.getlength(name)) + 16
        if lines[-1] and x + w > width:
            lines.append([])
            x = 0
        lines[-1].append((name, colour))
        x += w
    return lines


def _fit(font: Font, text: str, width: int) -> str:
    """`text`, cut from the left (the end of a name says most) to fit `width` pixels."""
    while font.getlength(text) > width and len(text) > 4:
        text = ".." + text[3:]
    return text


def _count(n: int) -> str:
    """A parameter count the way people say it: 512, 12.3k, 4.1M."""
    for scale, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)
