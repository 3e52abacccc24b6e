"""Calibrations of the step-time model: its free figures fitted to measured steps, and its
error measured, never assumed.

A **sample** is one compiled program and the step time a chip took to run it: a trial of a
study that ran on its devices (its program kept in the study's artifacts), a row of
``benchmarks/gpu_step_time.py``, or a published run whose step is known. A calibration fits the
model's :class:`~remat_search.targets.step_time.Efficiencies` (the fractions of each peak the
chip reaches, what each instruction costs besides its work) so that the estimates of its
samples come closest to their measured steps (least squares of the log ratio). Its error is
measured two ways: each sample's **leave-one-out** estimate (fitted on all the others, priced
on the one left out), and its **leave-one-family-out** estimate (fitted on the samples of every
other model family, priced on its family's: a model's runs at every chip count and batch left
out together, so that a sibling run does not stand in for the model). The band of a kind of plan
(keep / recompute / offload) is a 95% prediction interval of the measured / leave-one-family-out
ratios of its samples, counted by model family (:meth:`Calibration.band`): what the calibration
says of a model it never saw. A study that names a
calibration (``target.calibration``) prices every candidate with its figures and carries that
band with each estimate; ``show`` and ``best`` state it.

A calibration is a JSON file (:class:`Calibration`): the chips and compiler it was fitted
on, the figures, and every sample with its measured, uncalibrated, fitted and leave-one-out
step. ``remat-search calibrate`` writes one.
"""

from __future__ import annotations

import gzip
import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from remat_search.errors import SpecError
from remat_search.targets.chips import CHIPS, GPUS, Chip
from remat_search.targets.step_time import UNCALIBRATED, Efficiencies, StepEstimate, price
from remat_search.targets.work import Work, read_work

PlanKind = Literal["keep", "recompute", "offload"]
"""What a plan does with its layers' activations: keeps them all (no remat), recomputes some,
or offloads some to host memory (whatever else it does)."""
BAND_COVERAGE = 0.95
"""How often the step of a model a calibration never saw should land inside the band it prints
(:meth:`Calibration.band`): the band is a prediction interval at this coverage."""
BAND_SAMPLES = 3
"""The fewest samples of a kind of plan that band it alone; with fewer, every sample does: one or
two ratios are not a spread."""
_FLOOR = 0.05
"""The least fraction of a peak a fitted figure may be."""
_LAUNCH_BOUND = 1e-4


def chip_of(key: str) -> Chip:
    """The chip of a key of :data:`~remat_search.targets.chips.CHIPS` or ``GPUS`` (``v5e``, ``h100``)."""
    chip = {**CHIPS, **GPUS}.get(key)
    if chip is None:
        raise SpecError(f"calibration: unknown chip {key!r}; expected one of {sorted({**CHIPS, **GPUS})}")
    return chip


class Sample(BaseModel):
    """One compiled program and the step time its chip took."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    label: str
    chip: str
    """A key of ``CHIPS`` or ``GPUS``: ``v5e``, ``h100``, …"""
    program: str
    """The optimized HLO module's text (``.hlo``, or gzipped ``.hlo.gz``): a path, relative to the
    samples file that lists it."""
    measured_seconds: float = Field(gt=0)
    kind: PlanKind
    source: str = ""
    """Where the measured step comes from: a device and date, a published run's page."""
    family: str = ""
    """The model the program trains (``llama3.1-70b``), whatever its chips, mesh and batch: its
    family's samples are left out together (:attr:`Fitted.lofo_seconds`). Empty: its own family."""
    mesh: dict[str, int] = Field(default_factory=dict)
    """The mesh it ran over, axis sizes by name, where known: an estimate over a tensor axis
    wider than every sample's is outside them (:func:`with_band`)."""


class Fitted(BaseModel):
    """One sample in a calibration: its measured step and the model's estimates of it."""

    model_config = ConfigDict(frozen=True)

    label: str
    chip: str
    kind: PlanKind
    measured_seconds: float
    uncalibrated_seconds: float
    calibrated_seconds: float
    """Estimated with the figures fitted on every sample, this one included."""
    loo_seconds: float
    """Estimated with the figures fitted on every other sample."""
    source: str = ""
    family: str = ""
    mesh: dict[str, int] = Field(default_factory=dict)
    lofo_seconds: float | None = None
    """Estimated with the figures fitted on the samples of every other family (:attr:`Sample.family`):
    the calibration's error. None where no other family was sampled (and in calibrations written
    before it was measured): :attr:`held_out_seconds` is then the leave-one-out estimate."""

    @property
    def loo_error(self) -> float:
        """The leave-one-out estimate's error: estimated / measured - 1."""
        return self.loo_seconds / self.measured_seconds - 1

    @property
    def held_out_seconds(self) -> float:
        """The estimate the calibration's error is read from: leave-one-family-out where measured."""
        return self.lofo_seconds if self.lofo_seconds is not None else self.loo_seconds

    @property
    def held_out_error(self) -> float:
        """:attr:`held_out_seconds`' error: estimated / measured - 1."""
        return self.held_out_seconds / self.measured_seconds - 1


class Calibration(BaseModel):
    """The step-time model's figures fitted on measured steps, and its error left out (one sample,
    and one model family, at a time)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    chips: tuple[str, ...]
    """The chips of its samples: a study on another chip cannot use it."""
    compiler: str
    """The compiler its samples were compiled by (the figures describe that compiler's programs)."""
    efficiencies: Efficiencies
    fitted: tuple[str, ...]
    """Which figures were fitted (the others stay at the datasheet's chip)."""
    samples: tuple[Fitted, ...]

    def band(self, kind: PlanKind | None = None) -> tuple[float, float] | None:
        """Where the step of a model this calibration never saw should land, as multiples of its
        estimate (measured / estimate): the :func:`prediction_band` of its samples' measured /
        held-out estimate (leave-one-family-out where measured: :attr:`Fitted.held_out_seconds`).
        The samples are those of ``kind`` where it has :data:`BAND_SAMPLES` or more, else every
        sample (also where ``kind`` is None)."""
        chosen = [s for s in self.samples if s.kind == kind]
        if kind is None or len(chosen) < BAND_SAMPLES:
            chosen = list(self.samples)
        return prediction_band([s.measured_seconds / s.held_out_seconds for s in chosen],
                               [s.family or s.label for s in chosen])

    @property
    def widest_tensor(self) -> int | None:
        """The widest tensor axis of its samples (:func:`tensor_width`); None where none states its mesh."""
        widths = [tensor_width(s.mesh) for s in self.samples if s.mesh]
        return max(widths) if widths else None

    @property
    def families(self) -> int:
        """How many model families its samples hold."""
        return len({s.family or s.label for s in self.samples})

    def errors(self) -> dict[str, float]:
        """The largest held-out error (|estimated / measured - 1|) by kind of plan."""
        found: dict[str, float] = {}
        for s in self.samples:
            found[s.kind] = max(found.get(s.kind, 0.0), abs(s.held_out_error))
        return found


def prediction_band(ratios: Sequence[float], families: Sequence[str]) -> tuple[float, float] | None:
    """Where the ratio (measured / estimate) of a model none of ``ratios`` came from should land,
    :data:`BAND_COVERAGE` of the time: a prediction interval, never narrower than the ratios' own
    lowest and highest. Their logs' mean ± Student's t times their standard deviation and
    √(1 + 1/n), with n the distinct ``families`` (where two or more; else the ratios' number): a
    model's runs at several chip counts err together, so it is the families that say how a new
    model errs. None with fewer than two ratios: no spread is measured."""
    if len(ratios) < 2:
        return None
    from scipy.stats import t  # scipy.stats takes half a second to import: only here

    n = len(set(families)) if len(set(families)) >= 2 else len(ratios)
    logs = [math.log(r) for r in ratios]
    half = float(t.ppf((1 + BAND_COVERAGE) / 2, n - 1)) * statistics.stdev(logs) * math.sqrt(1 + 1 / n)
    middle = statistics.fmean(logs)
    return min(math.exp(middle - half), *ratios), max(math.exp(middle + half), *ratios)


def load_samples(path: Path) -> list[tuple[Sample, Path]]:
    """The samples a JSON file lists (a list of :class:`Sample`), each with its program's path.
    A bad file is a :class:`SpecError` naming the field."""
    try:
        listed = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SpecError(f"calibrate: samples file {path}: {e}") from None
    if not isinstance(listed, list):
        raise SpecError(f"calibrate: samples file {path}: expected a JSON list of samples, got {type(listed).__name__}")
    samples = []
    for i, item in enumerate(listed):
        try:
            samples.append(Sample.model_validate(item))
        except ValidationError as e:
            first = e.errors()[0]
            raise SpecError(f"calibrate: samples file {path} [{i}].{'.'.join(str(p) for p in first['loc'])}: "
                            f"{first['msg']}") from None
    for s in samples:
        chip_of(s.chip)
        if not (path.parent / s.program).is_file():
            raise SpecError(f"calibrate: samples file {path}: {s.label}.program: no file {path.parent / s.program}")
    return [(s, path.parent / s.program) for s in samples]


def read_program(path: Path) -> str:
    """A program's text, gzipped or not."""
    data = path.read_bytes()
    return (gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data).decode()


def fit(works: Sequence[Work], chips: Sequence[Chip], measured: Sequence[float],
        figures: Sequence[str] | None = None) -> Efficiencies:
    """The :class:`Efficiencies` under which the estimates of ``works`` on ``chips`` come closest
    to the ``measured`` seconds (least squares of log(estimated / measured)), fitting
    ``figures`` (default: :func:`figures_for` the samples) and leaving the others at the datasheet's."""
    from scipy.optimize import least_squares

    chosen = tuple(figures) if figures is not None else figures_for(works, chips)
    bounds = [(0.0, _LAUNCH_BOUND) if f == "launch_seconds" else (0.0, 1.0) if f == "host_overlap"
              else (math.log(_FLOOR), math.log(ceiling(f, chips))) for f in chosen]
    if not chosen:
        return UNCALIBRATED

    def efficiencies(x: Sequence[float]) -> Efficiencies:
        return Efficiencies(**{f: (v if f in ("launch_seconds", "host_overlap") else math.exp(v)) for f, v in zip(
            chosen, x, strict=True)})

    def residuals(x: Sequence[float]) -> list[float]:
        e = efficiencies(x)
        return [math.log(price(w, c, e).seconds / m) for w, c, m in zip(works, chips, measured, strict=True)]

    start = [0.5 if f == "host_overlap" else 0.0 if f == "launch_seconds" else min(0.0, hi - 0.1)
             for f, (_, hi) in zip(chosen, bounds, strict=True)]
    scale = [_LAUNCH_BOUND / 10 if f == "launch_seconds" else 1.0 for f in chosen]
    found = least_squares(residuals, start, bounds=([b[0] for b in bounds], [b[1] for b in bounds]),
                          x_scale=scale, diff_step=1e-6, xtol=1e-12, ftol=1e-12, gtol=1e-12)
    return efficiencies(found.x)


def ceiling(figure: str, chips: Sequence[Chip]) -> float:
    """The most a fitted fraction ``figure`` may reach on ``chips``: no more than the datasheet's
    peak (1) for the matmuls and the ICI, nor for the HBM but where the chip says more
    (:attr:`Chip.hbm_ceiling`); the host link up to the widest link a chip has
    (:attr:`Chip.host_link_ceiling`: a TPU's figure is an assumption, not a datasheet's)."""
    if figure == "hbm":
        return max(c.hbm_ceiling for c in chips)
    if figure == "host_link":
        return max((c.host_link_ceiling / c.host_bytes_per_second for c in chips if c.host_bytes_per_second), default=1.0)
    return 1.0


def figures_for(works: Sequence[Work], chips: Sequence[Chip]) -> tuple[str, ...]:
    """The figures samples can tell apart: matmul and HBM fractions and the launch cost always;
    the host link where a sample offloads, the ICI where a sample has collectives on a chip that
    prices them."""
    estimates = [price(w, c) for w, c in zip(works, chips, strict=True)]
    chosen = ["matmul", "hbm", "launch_seconds"]
    if any(e.host_bytes for e in estimates):
        chosen.append("host_link")
    if any(e.collective_seconds for e in estimates):
        chosen.append("ici")
    return tuple(chosen)


def calibrate(samples: Sequence[tuple[Sample, Path]], *, name: str, compiler: str,
              figures: Sequence[str] | None = None) -> Calibration:
    """Fit a :class:`Calibration` on ``samples`` (each with its program's path) and measure its
    error: each sample's leave-one-out estimate, fitted on the others alone, and its
    leave-one-family-out estimate, fitted on the other families' samples alone; a figure the
    samples fitted on do not tell (the host link, where those left out are the only ones that
    offload) left at the datasheet's."""
    if len(samples) < 2:
        raise SpecError(f"calibrate: {len(samples)} sample(s); a leave-one-out error needs at least 2")
    chips = [chip_of(s.chip) for s, _ in samples]
    works = [read_work(read_program(p), c.mxu) for (_, p), c in zip(samples, chips, strict=True)]
    measured = [s.measured_seconds for s, _ in samples]
    chosen = tuple(figures) if figures is not None else figures_for(works, chips)
    efficiencies = fit(works, chips, measured, chosen)

    def without(left_out: set[int]) -> Efficiencies:
        others = [j for j in range(len(samples)) if j not in left_out]
        telling = figures_for([works[j] for j in others], [chips[j] for j in others])  # the others may not tell one
        return fit([works[j] for j in others], [chips[j] for j in others], [measured[j] for j in others],
                   tuple(f for f in chosen if f in telling))

    loo = [price(works[i], chips[i], without({i})).seconds for i in range(len(samples))]
    families: dict[str, set[int]] = {}
    for i, (s, _) in enumerate(samples):
        families.setdefault(s.family or s.label, set()).add(i)
    lofo: dict[int, float] = {}
    for members in families.values():
        if len(members) == len(samples):
            continue  # one family: nothing else to fit on
        figures_out = None if len(members) == 1 else without(members)
        for i in members:
            lofo[i] = loo[i] if figures_out is None else price(works[i], chips[i], figures_out).seconds
    fitted = [Fitted(
        label=s.label, chip=s.chip, kind=s.kind, measured_seconds=s.measured_seconds, source=s.source, family=s.family,
        mesh=s.mesh,
        uncalibrated_seconds=price(works[i], chips[i]).seconds,
        calibrated_seconds=price(works[i], chips[i], efficiencies).seconds,
        loo_seconds=loo[i], lofo_seconds=lofo.get(i),
    ) for i, (s, _) in enumerate(samples)]
    return Calibration(name=name, chips=tuple(sorted({s.chip for s, _ in samples})), compiler=compiler,
                       efficiencies=efficiencies, fitted=chosen, samples=tuple(fitted))


def load_calibration(path: Path | str, field: str = "spec.target.calibration") -> Calibration:
    """The calibration written at ``path``; a missing or bad file is a :class:`SpecError`
    naming ``field``."""
    try:
        return Calibration.model_validate_json(Path(path).read_text())
    except OSError as e:
        raise SpecError(f"{field}: cannot read {path} ({e.strerror or e}); expected a file that remat-search calibrate wrote") from None
    except ValidationError as e:
        first = e.errors()[0]
        raise SpecError(f"{field}: {path} is not a calibration ({'.'.join(str(p) for p in first['loc'])}: "
                        f"{first['msg']}); expected a file that remat-search calibrate wrote") from None


KIND_WORDS: dict[PlanKind, str] = {"keep": "keeps every activation", "recompute": "recomputes", "offload": "offloads"}


def tensor_width(mesh: dict[str, int]) -> int:
    """How many ways a mesh splits tensors: the product of its ``tensor*`` axes (MaxText's
    ``tensor``, ``tensor_transpose``, ``tensor_sequence``); 1 without one."""
    return math.prod(n for axis, n in mesh.items() if axis.startswith("tensor"))


def banded_kind(kind: PlanKind, estimate: StepEstimate) -> PlanKind:
    """The kind of plan ``estimate`` is banded as: ``offload`` where its program moves bytes to the
    host (a memory knob offloads too, whatever the plan's layers do), else the plan's ``kind``."""
    return "offload" if estimate.host_bytes else kind


def with_band(estimate: StepEstimate, calibration: Calibration | None, kind: PlanKind,
              uncalibrated: tuple[float, float] | None = None, *, mesh: dict[str, int] | None = None,
              uncalibrated_tensor: int | None = None) -> StepEstimate:
    """``estimate`` labelled with its calibration's name and the band of its plan's ``kind``; or,
    uncalibrated, with the band ``uncalibrated`` (None: unknown), whose runs split tensors at
    most ``uncalibrated_tensor`` ways. Marked :attr:`~StepEstimate.outside` the samples the band
    was measured on where none of them is of that kind (the band is then every sample's), or
    where ``mesh``, the plan's, has a tensor axis wider than any of theirs."""
    widest = calibration.widest_tensor if calibration is not None else uncalibrated_tensor if uncalibrated else None
    reasons = []
    if calibration is not None and not any(s.kind == kind for s in calibration.samples):
        reasons.append(f"no sample {KIND_WORDS[kind]}")
    if mesh and widest is not None and tensor_width(mesh) > widest:
        reasons.append(f"tensors split {tensor_width(mesh)} ways, no sample's more than {widest}")
    outside = "; ".join(reasons) or None
    if calibration is None:
        return estimate.model_copy(update={"band": uncalibrated, "outside": outside})
    return estimate.model_copy(update={"calibration": calibration.name, "band": calibration.band(kind), "outside": outside})
