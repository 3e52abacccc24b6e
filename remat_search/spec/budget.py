"""A budget as a user writes it: bytes (``16GiB``, ``38mb``, ``1.5e10``), ``device`` (the
device's memory for a program) or a share of no remat's compiled peak (``70%``).

A new user rarely knows a model's peak before searching it; ``70%`` asks for plans that cut
no remat's peak by 30 % without a probe study. A search resolves a share by compiling the
uniform no-remat plan on its target (``search.opening``); a query (``best``, ``plan``,
``confirm``) resolves it against the study's stored trial of that plan
(``report.queries.budget_bytes``). :func:`read_budget` is the one parser of a budget given
to a query, by flag, argument or URL.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, model_serializer

from remat_search.errors import SpecError
from remat_search.spec.fields import Frozen
from remat_search.units import BYTES_EXPECTED, parse_bytes

DEVICE = "device"
BUDGET_EXPECTED = f"{BYTES_EXPECTED}, a share of no remat's peak such as 70%, or device"
SHARE_EXPECTED = "a share of no remat's peak above 0% and at most 100%, such as 70% or 62.5%"


class Share(Frozen):
    """A budget as a share of the compiled peak of the uniform no-remat plan (every layer
    ``none``) on the study's target, in percent; written ``70%``."""

    percent: float = Field(gt=0, le=100)

    def of(self, peak: int) -> int:
        """The bytes this share of ``peak`` is, rounded down to a whole byte (at least one)."""
        return max(1, math.floor(peak * self.percent / 100))

    def __str__(self) -> str:
        text = repr(self.percent)
        return f"{text.removesuffix('.0')}%"

    @model_serializer
    def _as_written(self) -> str:
        return str(self)


Asked = int | Share | Literal["device"]
"""A budget asked for: bytes, a share of no remat's peak, or the device's memory."""


def parse_budget(value: object) -> Asked:
    """The budget ``value`` names; :class:`ValueError` saying what is expected otherwise."""
    if isinstance(value, Share):
        return value
    if isinstance(value, str) and value.strip() == DEVICE:
        return DEVICE
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            percent = float(value.strip()[:-1])
        except ValueError:
            raise ValueError(f"expected {SHARE_EXPECTED}, got {value!r}") from None
        if not (math.isfinite(percent) and 0 < percent <= 100):
            raise ValueError(f"expected {SHARE_EXPECTED}, got {value!r}")
        return Share(percent=percent)
    try:
        return parse_bytes(value)
    except ValueError:
        raise ValueError(f"expected {BUDGET_EXPECTED}, got {value!r}") from None


def read_budget(value: object, *, name: str = "budget") -> Asked:
    """The budget ``value`` names, given to a query as ``name`` (``--budget``); else
    :class:`SpecError` naming it."""
    try:
        return parse_budget(value)
    except ValueError as e:
        raise SpecError(f"{name}: {e}") from None


def _spec_budget(value: object) -> int | Share | None:
    """A spec's budget: ``device`` is the budget left out (None: the device's memory)."""
    if value is None:
        return None
    budget = parse_budget(value)
    return None if budget == DEVICE else budget  # type: ignore[return-value]


Budget = Annotated[int | Share | None, BeforeValidator(_spec_budget)]
"""A pydantic field type for a spec's budget: bytes, a :class:`Share`, or None (the device's memory)."""
