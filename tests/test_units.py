import pytest

from remat_search.units import format_bytes, format_seconds, parse_bytes, parse_rate, parse_seconds, size_argument


@pytest.mark.parametrize(
    ("text", "expected"),
    [("200MiB", 200 * 2**20), ("16GiB", 16 * 2**30), ("80GB", 80 * 10**9), ("1.6e10", 16 * 10**9),
     (1024, 1024), ("64 MiB", 64 * 2**20)],
)
def test_parse_bytes_accepts_sizes_and_numbers(text: object, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["16 GiBs", "-1", 0, "abc", "", True, "inf", "nan", "14GiB!!", "32GB/h", "1 GiB 2 MiB"])
def test_parse_bytes_rejects_with_the_expected_form(text: object) -> None:
    with pytest.raises(ValueError, match="expected a positive size such as 200MiB"):
        parse_bytes(text)


@pytest.mark.parametrize(("text", "expected"), [("32GB/s", 32 * 10**9), ("32GB", 32 * 10**9), ("3.2e10", 32 * 10**9),
                                              (" 64GB/s ", 64 * 10**9), (10**9, 10**9)])
def test_parse_rate_reads_a_size_a_second(text: object, expected: int) -> None:
    assert parse_rate(text) == expected


@pytest.mark.parametrize("text", ["fast", "32GB/h", "0GB/s", "/s", True, "32Gb/s", "32gb", "256b/s"])
def test_parse_rate_rejects_with_the_expected_form(text: object) -> None:
    with pytest.raises(ValueError, match=r"expected bytes a second such as 32GB/s, 64GB/s or 3.2e10, got"):
        parse_rate(text)


@pytest.mark.parametrize(("text", "expected"), [("120s", 120.0), ("2m", 120.0), (3, 3.0), ("500ms", 0.5)])
def test_parse_seconds(text: object, expected: float) -> None:
    assert parse_seconds(text) == expected


@pytest.mark.parametrize("text", ["soon", "-5s", 0, "10 parsecs"])
def test_parse_seconds_rejects(text: object) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_seconds(text)


def test_format_bytes() -> None:
    assert format_bytes(200 * 2**20) == "200.0 MiB"
    assert format_bytes(512) == "512 B"


@pytest.mark.parametrize(("n", "text"), [(40 * 2**20, "40MiB"), (14 * 2**30, "14GiB"), (3 * 2**10, "3KiB"),
                                         (1000, "1KB"), (38 * 10**6, "38MB"), (16 * 10**9, "16GB"),
                                         (1001, "1001"), (40 * 2**20 + 1, "41943041")])
def test_size_argument_is_exact_and_short(n: int, text: str) -> None:
    assert size_argument(n) == text and parse_bytes(text) == n


@pytest.mark.parametrize(("seconds", "text"), [
    (0.000388, "0.388 ms"), (0.000439, "0.439 ms"), (0.0612, "61.2 ms"), (0.695, "695 ms"),
    (0.0099, "9.90 ms"), (1.234, "1.23 s"), (12.34, "12.3 s"), (1234.0, "1234 s"), (0.0, "0.00 ms"),
])
def test_format_seconds_shows_three_significant_digits(seconds: float, text: str) -> None:
    assert format_seconds(seconds) == text


def test_step_times_a_few_percent_apart_print_apart() -> None:
    """Estimated TPU step times of 0.388–0.439 ms all printed "0.4 ms" (issue 23)."""
    times = [0.000388, 0.000401, 0.000412, 0.000425, 0.000439]
    assert len({format_seconds(t) for t in times}) == len(times)
