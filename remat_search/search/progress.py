"""What a search or a confirmation is doing, as it happens: the events its caller hears."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, ConfigDict

from remat_search.measure.device import DeviceInfo
from remat_search.report.results import TrialResult


class Progress(BaseModel):
    """What a search or a confirmation is doing, told to its ``on_progress`` callback.

    - ``start``: the study is open: ``done`` of its ``total`` trials are finished (all of them
      on a finished study's rerun), measured on ``device`` within ``budget``;
    - ``trial``: ``trial`` (its number, plan and labels; status ``running``) is about to be
      measured, or, with ``cached_from``/``reused_from``, a stored measurement reused for it;
    - ``result``: it was recorded (``trial`` as stored), ``done`` of ``total``;
    - ``confirm``: ``plans`` plans are about to be re-timed interleaved, ``rounds`` rounds; in
      ``race`` 0 the top plans and presets, in each later race with the new leader added;
    - ``confirmed``: they were; with ``reused``, they had been re-timed together before with at
      least ``rounds`` rounds, and those stored times stand: nothing was re-timed; with
      ``exhausted``, the races ran out while a plan timed only by the search ranked first;
    - ``confirm_elsewhere``: ``holder`` (``host pid``), another process sharing the study, is
      confirming it: this one leaves it to it.
    """

    model_config = ConfigDict(frozen=True)

    event: Literal["start", "trial", "result", "confirm", "confirmed", "confirm_elsewhere"]
    done: int = 0
    total: int = 0
    device: DeviceInfo | None = None
    budget: int | None = None
    trial: TrialResult | None = None
    plans: int = 0
    rounds: int = 0
    reused: bool = False
    race: int = 0
    exhausted: bool = False
    holder: str | None = None


ProgressCallback = Callable[[Progress], None]
