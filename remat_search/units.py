"""Byte sizes and durations as users write them: ``200MiB``, ``16GiB``, ``1.6e10``, ``120s``.

Byte units come from pydantic's :class:`~pydantic.ByteSize` (``KiB``/``MiB``/``GiB`` are
powers of two, ``KB``/``MB``/``GB`` powers of ten); plain numbers, scientific notation
included, are bytes. Both parsers raise :class:`ValueError` with the expected form, which
pydantic turns into a field error and the CLI into a one-line message.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Annotated

from pydantic import BeforeValidator, ByteSize, TypeAdapter, ValidationError


@functools.cache
def _byte_size() -> TypeAdapter[ByteSize]:
    """pydantic's reader of byte sizes, built when a size is first read (not on import: the
    CLI's ``--help`` imports this module and reads none)."""
    return TypeAdapter(ByteSize)


_SIZE = re.compile(r"\s*(\d*\.?\d+)\s*[A-Za-z]*\s*")
"""A size as ByteSize reads one, whole: it reads a number and a unit from the start of its text
and leaves whatever follows unread."""
_BITS = re.compile(r"[A-Za-z]?b\s*$")
"""A unit of bits: ``Gb``, ``Mb``, ``b``."""
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|min|h)?\s*$")
_SECONDS_PER_UNIT = {"ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}
BYTES_EXPECTED = "a positive size such as 200MiB, 16GiB, 80GB or 1.6e10"
RATE_EXPECTED = "bytes a second such as 32GB/s, 64GB/s or 3.2e10"
MAX_SECONDS = 30 * 24 * 3600.0
"""The longest duration accepted: a month is longer than any wait that makes sense, and
longer ones overflow the clocks that waits use (``1e300`` seconds is no timeout)."""


def parse_bytes(value: object) -> int:
    """Return the positive number of bytes ``value`` names."""
    if isinstance(value, bool):
        raise ValueError(f"expected {BYTES_EXPECTED}, got {value!r}")  # noqa: TRY004 (pydantic validators need ValueError)
    try:
        number = float(value) if not isinstance(value, int) else _float(value)  # type: ignore[arg-type]  # "1.6e10", "-1"
    except (TypeError, ValueError):
        if isinstance(value, str) and not _SIZE.fullmatch(value):  # ByteSize reads "32GB/h" as 32GB
            raise ValueError(f"expected {BYTES_EXPECTED}, got {value!r}") from None
        try:
            number = _float(_byte_size().validate_python(value))
        except ValidationError:
            raise ValueError(f"expected {BYTES_EXPECTED}, got {value!r}") from None
        except OverflowError:  # ByteSize's own int(float("1e400") * unit)
            number = math.inf
    if not math.isfinite(number) or int(number) <= 0:  # 0.5 is no byte
        raise ValueError(f"expected {BYTES_EXPECTED}, got {value!r}")
    return int(number)


def parse_rate(value: object) -> int:
    """Return the positive bytes a second ``value`` names: a size, ``/s`` after it or not
    (``32GB/s``, ``32GB``, ``3.2e10``). A unit in a small ``b`` (``32Gb/s``) is refused: links
    are quoted in bits so, which ByteSize would read as bytes, eight times the link."""
    text = value.strip().removesuffix("/s") if isinstance(value, str) else value
    if isinstance(text, str) and _BITS.search(text):
        raise ValueError(f"expected {RATE_EXPECTED}, got {value!r}, which is bits (B is bytes)")
    try:
        return parse_bytes(text)
    except ValueError:
        raise ValueError(f"expected {RATE_EXPECTED}, got {value!r}") from None


def _float(n: int) -> float:
    """``n`` as a float; an int past the largest float is infinite (of its sign), not an OverflowError."""
    try:
        return float(n)
    except OverflowError:
        return math.inf if n > 0 else -math.inf


def parse_seconds(value: object) -> float:
    """Return the positive number of seconds ``value`` names (``120``, ``120s``, ``2m``)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = value if isinstance(value, float) else _float(value)
    else:
        match = _DURATION.match(str(value))
        if match is None:
            raise ValueError(f"expected a duration such as 90s, 2m or 1h, got {value!r}")
        seconds = float(match[1]) * _SECONDS_PER_UNIT[match[2] or "s"]
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"expected a positive duration such as 90s, got {value!r}")
    if seconds > MAX_SECONDS:
        raise ValueError(f"expected a duration of at most 30 days ({MAX_SECONDS:g} s), got {value!r}")
    return seconds


def format_bytes(n: float) -> str:
    """Render a byte count with a binary unit: ``209715200`` → ``200.0 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def size_argument(n: int) -> str:
    """Write ``n`` bytes as a size :func:`parse_bytes` reads back exactly, the shortest of a whole
    number of binary units, decimal units or bytes (binary first): ``40 * 2**20`` → ``40MiB``,
    ``38_000_000`` → ``38MB``, ``1001`` → ``1001``. For commands and messages we print."""
    units = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3))
    exact = [f"{n // scale}{unit}" for unit, scale in units if n % scale == 0]
    return min([*exact, str(n)], key=len)


def format_seconds(s: float) -> str:
    """Render a step time to three significant digits, so that plans a few percent apart read
    apart (``0.388 ms``, ``0.439 ms``; ``61.2 ms``, ``695 ms``): milliseconds below a second,
    seconds from one (``1.23 s``; whole seconds from a thousand)."""
    value, unit = (s * 1e3, "ms") if s < 1 else (s, "s")
    return f"{value:.{_decimals_for_3_digits(value)}f} {unit}"


def _decimals_for_3_digits(x: float) -> int:
    """Decimal places that show ``x`` (≥ 0) to three significant digits (none from 100 up)."""
    if not x > 0 or not math.isfinite(x):
        return 2
    return max(0, 2 - math.floor(math.log10(x)))


def format_duration(s: float) -> str:
    """Render a wait, e.g. an estimated time to finish, to the minute beyond one:
    ``42 s``, ``17 min``, ``2 h 05 min``, ``3 d 4 h``."""
    s = max(0, round(s))
    if s < 60:
        return f"{s} s"
    minutes = round(s / 60)
    if minutes < 60:
        return f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours} h {minutes:02d} min"
    days, hours = divmod(round(s / 3600), 24)
    return f"{days} d {hours} h"


Bytes = Annotated[int, BeforeValidator(parse_bytes)]
"""A pydantic field type for positive byte counts written as sizes."""

BytesPerSecond = Annotated[int, BeforeValidator(parse_rate)]
"""A pydantic field type for a link's bandwidth, bytes a second written as sizes (``32GB/s``)."""

Seconds = Annotated[float, BeforeValidator(parse_seconds)]
"""A pydantic field type for positive durations."""
