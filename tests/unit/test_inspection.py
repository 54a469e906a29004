import time

import numpy as np

from lightning_elastic.inspection import (
    MAP_STATES,
    MAX_COLUMNS,
    MAX_ROWS,
    ROW,
    module_rows,
    profile_table,
    selection_map,
    selection_states,
)
from lightning_elastic.profiling import TimingProfile
from lightning_elastic.records import Decision, Mask, SelectionRecord


def test_profile_table_lists_every_tensor_in_milliseconds() -> None:
    profile = TimingProfile(
        names=("a.weight", "b.weight"),
        t_dw=(0.002, 0.0005),
        t_dy=(0.0, 0.001),
        t_fw=0.004,
        t_full=0.0075,
        device="cpu",
        fingerprint="f",
        unused=("c.weight",),
        method="measured",
        numel=(10, 20),
    )
    lines = profile_table(profile, selected=[False, True]).splitlines()
    assert lines[2] == "| 0 | a.weight | 10 | 2.000 | 0.000 | no |"
    assert lines[3] == "| 1 | b.weight | 20 | 0.500 | 1.000 | yes |"
    assert "unused parameters: c.weight" in lines[-1]


def record(flags: list[bool], step: int = 0, epoch: int = 0) -> SelectionRecord:
    return SelectionRecord(step, epoch, Decision(Mask.of(flags), (0.0,) * len(flags), 0.1, 0.1), full_seconds=0.2)


def test_states_mark_the_frozen_prefix_and_the_pins() -> None:
    history = [record([False, False, True, False, True]), record([True, False, False, False, False])]
    states = selection_states(history, required=[False] * 4 + [True], forbidden=[False, True, False, False, False])
    names = [name for name, _ in MAP_STATES]
    trained, passes, prefix = names.index("trained"), names.index("frozen, gradient passes through"), 2
    assert states[:, 0].tolist() == [prefix, 4, trained, passes, 3]
    assert states[:, 1].tolist() == [trained, 4, passes, passes, 3]


def test_rows_are_tensors_up_to_the_limit_then_modules_in_model_order() -> None:
    names = [f"model.blocks.{b}.layer{k}.weight" for b in range(4) for k in range(3)]
    assert [label for label, _, _ in module_rows(names, max_rows=12)] == [n[len("model.") :] for n in names]
    assert module_rows(names, max_rows=4) == [(f"blocks.{b}.* (3)", 3 * b, 3 * b + 3) for b in range(4)]
    assert module_rows(names, max_rows=2) == [("blocks.* (12)", 0, 12)]
    # the rows go where the parameters are: the big block shows its layers, the small ones stay whole
    weighted = module_rows(names, max_rows=6, numel=[1] * 9 + [100] * 3)
    assert [label for label, _, _ in weighted] == [
        *(f"blocks.{b}.* (3)" for b in range(3)),
        *(f"blocks.3.layer{k}.weight" for k in range(3)),
    ]
    chunks = module_rows([f"w{k}" for k in range(10)], max_rows=3)
    assert [(a, b) for _, a, b in chunks] == [(0, 4), (4, 8), (8, 10)]


def test_map_cells_show_each_state_and_blend_a_module_by_parameter_count() -> None:
    names = ["a.weight", "b.weight", "c.weight"]
    image = selection_map([record([False, True, False]), record([True, True, True])], names, [1, 3, 5],
                          [False] * 3, [False, False, True])
    colours = {colour for _, colour in MAP_STATES}
    seen = {tuple(int(c) for c in px) for px in image.reshape(-1, 3)}
    assert colours <= seen  # every state's colour appears, in the grid or in the legend
    many = [f"m.layer{k // 100}.t{k}" for k in range(300)]  # 3 modules of 100 tensors; half of one trained
    flags = [k < 50 for k in range(300)]
    numel = [3 if k < 50 else 1 for k in range(300)]  # the trained half holds 3/4 of the module's elements
    big = selection_map([record(flags)], many, numel, [False] * 300, [False] * 300)
    trained, passes = np.array(MAP_STATES[0][1]), np.array(MAP_STATES[1][1])
    blend = np.round(0.75 * trained + 0.25 * passes).astype(np.uint8)
    assert (big.reshape(-1, 3) == blend).all(axis=1).any()


def test_map_of_two_thousand_tensors_is_bounded_and_fast() -> None:
    rng = np.random.default_rng(0)
    names = [f"model.encoder.layers.{k // 40}.attn{(k // 8) % 5}.w{k % 8}" for k in range(2000)]
    history = [record(list(rng.random(2000) < 0.3), step=10 * s, epoch=s) for s in range(300)]
    started = time.perf_counter()
    image = selection_map(history, names, [1000] * 2000, [False] * 2000, [False] * 2000)
    assert time.perf_counter() - started < 1.0
    assert image.dtype == np.uint8 and image.shape[0] <= 8 + 3 * ROW + MAX_ROWS * ROW + 8 + 3 * ROW
    assert image.shape[1] <= 260 + MAX_COLUMNS * 6 + 100
    small = selection_map([record([k % 3 == 0 for k in range(20)])] * 3, names[:20], [10] * 20, [False] * 20, [False] * 20)
    assert small.shape[0] == 8 + 3 * ROW + 20 * ROW + 8 + ROW * 3  # 20 rows, a legend of two lines
