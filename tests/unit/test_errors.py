import numpy as np
import pytest

from lightning_elastic.errors import is_positive_int


@pytest.mark.parametrize(
    ("value", "expected"),
    [(1, True), (7, True), (np.int64(3), True), (0, False), (-2, False), (True, False), (2.0, False), ("3", False)],
)
def test_positive_ints_are_integers_above_zero_and_not_bools(value: object, expected: bool) -> None:
    assert is_positive_int(value) is expected
