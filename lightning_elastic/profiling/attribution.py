"""From node and op times to per-tensor costs, and lining up passes whose graphs differ."""

from __future__ import annotations

import difflib
import itertools
import statistics
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from torch import nn

from lightning_elastic.profiling.graph import Node, Pass


class StructureMismatch(RuntimeError):
    """Two passes that should record the same graph did not.

    Raised for two passes with the same selection: `compute_loss` must run the same ops each time it is
    called (its control flow may depend on the batch, which is fixed, and on seeded randomness only).
    """


@dataclass
class RawCosts:
    """Costs before they are folded into the time model.

    ``dw[k]`` is tensor ``k``'s weight-gradient time; ``by_level[l + 1]`` the time that is paid iff the
    deepest selected tensor is at most ``l`` (``l = -1``: never paid; ``l = n - 1``: always paid).
    """

    dw: list[float]
    by_level: list[float]

    def model(self) -> tuple[list[float], list[float], float]:
        """``(t_dw, t_dy, t_tail)``: the cost paid iff ``d <= l`` becomes ``t_dy[l + 1]``."""
        n = len(self.dw)
        t_dy = [0.0] + [max(v, 0.0) for v in self.by_level[1:n]]
        return [max(v, 0.0) for v in self.dw], t_dy, max(self.by_level[n], 0.0)


class Structure:
    """Forward order of the parameters and the level of every backward node, from one full graph."""

    def __init__(self, record: Pass, params: list[nn.Parameter]) -> None:
        index = {id(p): c for c, p in enumerate(params)}
        leaf_param = {node: index.get(id(node.variable), -1) for node in record.leaf_nodes}
        first_use: dict[int, int] = {}
        for node in record.nodes:
            for nxt, _ in node.next_functions:
                c = leaf_param.get(nxt, -1)
                if c >= 0:
                    first_use[c] = min(first_use.get(c, node._sequence_nr()), node._sequence_nr())
        self.order = sorted(first_use, key=first_use.__getitem__)
        position = {c: i for i, c in enumerate(self.order)}
        self.n = len(self.order)
        self.numel = [params[c].numel() for c in self.order]
        self.record = record
        sources = set(record.sources)
        # level: highest forward index of the parameters a node's gradient reaches (-1: none);
        # data: whether it reaches a converted input, i.e. also runs when every parameter is frozen.
        self.level: dict[Node, int] = {}
        self.data: dict[Node, bool] = {}
        for node, c in leaf_param.items():
            self.level[node] = position.get(c, -1)
            self.data[node] = c < 0
        for node in record.nodes:  # inputs are created, hence numbered, before the ops that use them
            nexts = [nxt for nxt, _ in node.next_functions if nxt is not None]
            self.level[node] = max((self.level.get(nxt, -1) for nxt in nexts), default=-1)
            self.data[node] = any(self.data.get(nxt, False) or nxt in sources for nxt in nexts)
        self._owners_memo: dict[Node, dict[int, float]] = {}
        self._position = {node: position[c] for node, c in leaf_param.items() if c in position}
        self._by_id = {id(params[c]): k for c, k in position.items()}
        self.sources = sources

    def _is_data_edge(self, node: Node) -> bool:
        return self.data.get(node, False) or node in self.sources

    def owners(self, node: Node) -> dict[int, float]:
        """Forward positions of the parameters that a parameter-only subgraph reaches, numel-weighted."""
        if node in self._owners_memo:
            return self._owners_memo[node]
        if node in self._position:
            found = {self._position[node]: 1.0}
        else:
            found = {}
            for nxt, _ in node.next_functions:
                if nxt is not None and not self._is_data_edge(nxt):
                    found.update(self.owners(nxt))
        self._owners_memo[node] = found
        return found

    def _split(self, owners: Mapping[int, float]) -> dict[int, float]:
        total = sum(self.numel[k] for k in owners)
        return {k: self.numel[k] / total for k in owners}

    def dx_level(self, node: Node) -> int:
        return max(
            (self.level[nxt] for nxt, _ in node.next_functions if nxt is not None and self._is_data_edge(nxt)),
            default=-1,
        )

    def costs(self, full: list[Pass], dx: list[Pass], none: list[Pass]) -> RawCosts:
        """Median node and op times of the instrumented passes, turned into raw costs."""
        names = self.record.node_names
        full_seconds = aligned_median(names, full, lambda p: (p.node_names, p.node_seconds))
        data_nodes = [n for n in self.record.nodes if self.data[n]]
        data_names = [n.name() for n in data_nodes]
        full_data = [t for n, t in zip(self.record.nodes, full_seconds, strict=True) if self.data[n]]
        try:
            dx_list = aligned_median(data_names, dx, lambda p: (p.node_names, p.node_seconds))
        except StructureMismatch:
            # Some ops take another route when their parameters are frozen (matmul folds differently, a
            # parameter's expand disappears): line the two graphs up where they agree.
            dx_list = [
                statistics.median(column)
                for column in zip(
                    *(matched(p.node_names, p.node_seconds, data_names, full_data) for p in dx),
                    strict=True,
                )
            ]
        dx_seconds = dict(zip(data_nodes, dx_list, strict=True))
        raw = RawCosts(dw=[0.0] * self.n, by_level=[0.0] * (self.n + 1))
        for node, seconds in zip(self.record.nodes, full_seconds, strict=True):
            if self.data[node]:
                level = self.dx_level(node)
                raw.by_level[level + 1] += dx_seconds[node]
                owners: dict[int, float] = {}
                for nxt, _ in node.next_functions:
                    if nxt is not None and not self._is_data_edge(nxt):
                        owners.update(self.owners(nxt))
                extra = seconds - dx_seconds[node]
                if owners:
                    for k, share in self._split(owners).items():
                        raw.dw[k] += extra * share
                else:
                    raw.by_level[level + 1] += extra
            else:
                for k, share in self._split(self.owners(node)).items():
                    raw.dw[k] += seconds * share
        leaf_seconds = [statistics.median(v) for v in zip(*(p.leaf_seconds for p in full), strict=True)]
        for node, seconds in zip(self.record.leaf_nodes, leaf_seconds, strict=True):
            if node in self._position:
                raw.dw[self._position[node]] += seconds
        self._forward_costs(full, dx, none, raw)
        return raw

    def _forward_costs(self, full: list[Pass], dx: list[Pass], none: list[Pass], raw: RawCosts) -> None:
        """Charge the forward work that graph recording adds.

        An op costs ``none`` when nothing it reads requires grad, ``dx`` when its input does (paid iff the
        deepest selected tensor is at most the input's level) and ``full`` when its parameters do too
        (the difference is paid iff those parameters are selected: part of their ``t_dw``).
        """
        names = self.record.op_names
        try:
            t_full = aligned_median(names, full, lambda p: (p.op_names, p.op_seconds))
            t_dx = aligned_median(names, dx, lambda p: (p.op_names, p.op_seconds))
            t_none = aligned_median(names, none, lambda p: (p.op_names, p.op_seconds))
        except StructureMismatch as err:
            warnings.warn(
                f"The forward pass runs different ops when nothing requires grad ({err}); the cost of "
                "recording the graph is left to the calibration against plain timings.",
                stacklevel=4,
            )
            return
        for op, a, b, c in zip(self.record.op_kept, t_full, t_dx, t_none, strict=True):
            out_levels = [self.level[node] for node in op.outputs if node in self.level]
            if not out_levels:
                continue  # recorded nothing that the loss depends on
            in_level = max((self.level.get(node, -1) for node in op.inputs), default=-1)
            raw.by_level[in_level + 1] += b - c
            owners = {self._by_id[i]: 1.0 for i in op.params if i in self._by_id}
            for node in op.inputs:
                if node in self.level and not self._is_data_edge(node):
                    owners.update(self.owners(node))
            if owners:
                for k, share in self._split(owners).items():
                    raw.dw[k] += (a - b) * share
            else:
                raw.by_level[max(out_levels) + 1] += a - b

    def flop_costs(self, record: Pass) -> RawCosts:
        """Analytic costs of the ops of ``record`` (kept by `Runner._run_flops`)."""
        raw = RawCosts(dw=[0.0] * self.n, by_level=[0.0] * (self.n + 1))
        for costs, data_fns in record.op_kept:
            level = max((self.level.get(node, -1) for node in data_fns), default=-1)
            raw.by_level[level + 1] += costs.dx
            for param_id, value in costs.dw.items():
                if param_id in self._by_id:
                    raw.dw[self._by_id[param_id]] += value
        return raw


def aligned_median(
    names: list[str], passes: list[Pass], get: Callable[[Pass], tuple[list[str], list[float]]]
) -> list[float]:
    """Per-position median over passes whose sequences of names equal ``names``."""
    columns = []
    for record in passes:
        got_names, seconds = get(record)
        if got_names != names:
            first = next(i for i, pair in enumerate(itertools.zip_longest(got_names, names)) if pair[0] != pair[1])
            raise StructureMismatch(
                f"{len(got_names)} vs {len(names)} entries, first difference at {first}: "
                + " vs ".join(repr(seq[first]) if first < len(seq) else "end" for seq in (got_names, names))
            )
        columns.append(seconds)
    return [statistics.median(values) for values in zip(*columns, strict=True)] if names else []


def matched(
    got_names: Sequence[str], got_seconds: Sequence[float], names: Sequence[str], reference: Sequence[float]
) -> list[float]:
    """The seconds of a pass over a graph that differs from ``names``, put on the positions of ``names``.

    Runs of nodes that the two sequences share take their own times; a run of ``names`` that the pass did
    differently shares the time the pass spent on its replacement, in proportion to ``reference`` (times of
    the same positions measured elsewhere); work the pass did with no counterpart goes to the position before.
    """
    seconds = [0.0] * len(names)
    if not names:
        return seconds
    matcher = difflib.SequenceMatcher(None, list(names), list(got_names), autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            seconds[i1:i2] = got_seconds[j1:j2]
        elif i1 == i2:
            seconds[max(i1 - 1, 0)] += sum(got_seconds[j1:j2])
        else:
            spent, weights = sum(got_seconds[j1:j2]), reference[i1:i2]
            total = sum(weights)
            for i, weight in zip(range(i1, i2), weights, strict=True):
                seconds[i] += spent * (weight / total if total > 0 else 1 / (i2 - i1))
    return seconds

