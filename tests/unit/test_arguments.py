"""`Speedup` and `PositiveInt`: the checks that a command-line parser runs as it reads a value."""

from __future__ import annotations

import math
import sys

import pytest

from lightning_elastic import ElasticConfigError, arguments
from lightning_elastic.arguments import PositiveInt, Speedup, speedup_problem


@pytest.mark.parametrize(("value", "expected"), [("2.5", 2.5), ("3", 3.0), (1.5, 1.5), (4, 4.0)])
def test_a_speedup_reads_numbers_and_their_text(value: object, expected: float) -> None:
    assert Speedup(value) == expected and type(Speedup(value)) is Speedup


@pytest.mark.parametrize(
    ("value", "shown"), [("abc", "'abc'"), ("0.5", "0.5"), (1, "1"), ("nan", "nan"), (True, "True")]
)
def test_a_speedup_refuses_with_the_constructors_message(value: object, shown: str) -> None:
    with pytest.raises(ElasticConfigError) as refusal:
        Speedup(value)
    assert str(refusal.value) == f"`speedup` must be a finite number > 1. Found: {shown}"


def test_the_constructor_check_refuses_text_that_the_parser_would_read() -> None:
    assert speedup_problem("2") == "`speedup` must be a finite number > 1. Found: '2'"
    assert speedup_problem(math.inf) == "`speedup` must be a finite number > 1. Found: inf"
    assert speedup_problem(1.0001) is None


def test_speedup_is_registered_with_jsonargparse_when_it_is_installed() -> None:
    typing = pytest.importorskip("jsonargparse.typing")
    registered = typing.get_registered_type(Speedup)
    assert registered is not None and registered.serializer(Speedup(2.5)) == 2.5


def test_without_jsonargparse_registration_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "jsonargparse", None)  # `import jsonargparse` now raises ImportError
    monkeypatch.setitem(sys.modules, "jsonargparse.typing", None)
    arguments._register_with_jsonargparse()  # returns quietly: the library needs only torch and lightning


@pytest.mark.parametrize(("value", "expected"), [("3", 3), (2, 2), ("1000", 1000)])
def test_a_positive_int_reads_ints_and_their_text(value: object, expected: int) -> None:
    assert PositiveInt(value) == expected and type(PositiveInt(value)) is PositiveInt


@pytest.mark.parametrize(("value", "shown"), [("0", "0"), (-2, "-2"), ("1.5", "'1.5'"), (2.0, "2.0"), (True, "True")])
def test_a_positive_int_refuses_what_the_constructor_refuses(value: object, shown: str) -> None:
    with pytest.raises(ElasticConfigError) as refusal:
        PositiveInt(value)
    assert str(refusal.value) == f"must be a positive int. Found: {shown}"


def test_the_constructor_still_names_a_bad_count_given_in_python() -> None:
    from lightning_elastic import ElasticTensorSelection

    with pytest.raises(ElasticConfigError, match=r"`interval` must be a positive int. Found: 0"):
        ElasticTensorSelection(interval=0)
