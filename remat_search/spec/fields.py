"""What every part of a spec is built from: a frozen model that forbids unknown keys, and the
checks of names written in it (study names, import paths, mesh axes)."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict

STUDY_NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def check_study_name(value: str) -> str:
    """Return ``value`` if it is a usable study name, else raise :class:`ValueError`."""
    return matching(
        value, STUDY_NAME_PATTERN,
        "a study name of letters, digits, '.', '_' or '-' (starting with a letter or digit, at most 128)",
    )


def matching(value: str, pattern: str, expected: str) -> str:
    if not re.fullmatch(pattern, value):
        raise ValueError(f"expected {expected}, got {value!r}")
    return value
