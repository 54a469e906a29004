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


def test_patterns_given_as_an_iterator_are_kept_not_used_up_by_the_checks() -> None:
    from lightning_elastic import ElasticTensorSelection

    callback = ElasticTensorSelection(train_always=iter(["fc.*"]), train_never=(p for p in ["stem.*"]))
    assert (callback._settings.train_always, callback._settings.train_never) == (("fc.*",), ("stem.*",))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"resolution": 10**12}, "`resolution` must be a positive int of at most 100000. Found: 1000000000000"),
        ({"cache_dir": ""}, "`cache_dir` must be a directory path, None (the user cache) or False. Found: ''"),
        ({"profile": ""}, "`profile` must be the path of a saved timing profile. Found: '' (no such file)"),
        ({"profile": "/nonexistent/p.json"}, "saved timing profile. Found: '/nonexistent/p.json' (no such file)"),
        ({"profile": "/tmp"}, "`profile` must be the path of a saved timing profile. Found: '/tmp' (not a file)"),
        ({"resolution": 100_001}, "`resolution` must be a positive int of at most 100000. Found: 100001"),
        ({"cache_dir": 0}, "`cache_dir` must be a directory path, None (the user cache) or False. Found: 0"),
    ],
)
def test_settings_that_would_fail_in_the_fit_are_refused_as_the_callback_is_made(
    kwargs: dict[str, object], message: str
) -> None:
    """A resolution that the first selection cannot allocate (7 TiB), an empty cache directory (it wrote the
    profiles into the working directory), a profile that is not there (refused only as the fit started)."""
    from lightning_elastic import ElasticTensorSelection

    with pytest.raises(ElasticConfigError) as refused:
        ElasticTensorSelection(**kwargs)  # type: ignore[arg-type]
    assert message in str(refused.value)


def test_the_largest_resolution_is_taken() -> None:
    from lightning_elastic import ElasticTensorSelection

    assert ElasticTensorSelection(resolution=arguments.MAX_RESOLUTION)._settings.resolution == 100_000
