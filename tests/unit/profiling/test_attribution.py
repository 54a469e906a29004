"""Node times to tensors: aligning passes whose graphs differ."""

from __future__ import annotations

from lightning_elastic.profiling.attribution import matched


def test_matched_puts_a_differing_pass_on_the_reference_positions() -> None:
    names = ["Add", "Mm", "View", "Relu", "Sum"]
    reference = [1.0, 3.0, 1.0, 2.0, 1.0]
    # Same graph: one to one.
    assert matched(names, [1.5, 2.5, 0.5, 2.0, 1.0], names, reference) == [1.5, 2.5, 0.5, 2.0, 1.0]
    # "Mm, View" done as "Expand, Bmm, View": the 6 s of that run split 3:1 like the reference's Mm and View.
    got = ["Add", "Expand", "Bmm", "View2", "Relu", "Sum"]
    assert matched(got, [1.0, 2.0, 3.0, 1.0, 2.0, 1.0], names, reference) == [1.0, 4.5, 1.5, 2.0, 1.0]
    # An extra node with no counterpart: its time goes to the position before it.
    got = ["Add", "Mm", "View", "Clone", "Relu", "Sum"]
    assert matched(got, [1.0, 3.0, 1.0, 0.5, 2.0, 1.0], names, reference) == [1.0, 3.0, 1.5, 2.0, 1.0]
    # A node the pass did not run costs nothing there; the total time is always kept.
    got = ["Add", "Mm", "Relu", "Sum"]
    assert matched(got, [1.0, 3.0, 2.0, 1.0], names, reference) == [1.0, 3.0, 0.0, 2.0, 1.0]
