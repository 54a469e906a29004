import numpy as np

from lightning_elastic.inspection import ALWAYS, FROZEN, NEVER, TRAINED, profile_table, selection_heatmap
from lightning_elastic.profiler import TimingProfile


def test_heatmap_cells_show_each_tensor_at_each_selection() -> None:
    history = [[True, False, True], [False, False, True]]
    image = selection_heatmap(history, required=[False, False, True], forbidden=[False, True, False], cell=2)
    assert image.shape == (6, 4, 3) and image.dtype == np.uint8
    cells = image[::2, ::2]
    assert tuple(cells[0, 0]) == TRAINED and tuple(cells[0, 1]) == FROZEN
    assert tuple(cells[1, 0]) == NEVER and tuple(cells[1, 1]) == NEVER
    assert tuple(cells[2, 0]) == ALWAYS
    assert (image[0:2, 0:2] == np.array(TRAINED, dtype=np.uint8)).all()


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
