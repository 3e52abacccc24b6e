"""The advice: ``remat-search plan``'s answer, the plan to use for a budget (:func:`plan_for_budget`).

The study's cost model (:mod:`search.cost_model`), fitted to what the study measured (kept
in the study by its search, else fitted here), is solved for the budget; where the study's fastest measured plan that fits is faster than the
model's plan, or no plan is predicted to fit, that measured plan is the advice. The study is
read through the one reader of studies (:mod:`report.stored`): plain SQL, no optuna, and
without importing the search (only ``--measure`` runs one), so ``plan`` answers about as fast
as ``best``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from remat_search.errors import NoFeasiblePlan, SpecError, StorageError
from remat_search.plans.plan import RematPlan, collapse_runs
from remat_search.report.queries import budget_bytes
from remat_search.report.results import TrialResult
from remat_search.report.stored import StoredStudy, open_study
from remat_search.search.cost_model import CostModel, Prediction, cost_model, kept_cost_model
from remat_search.search.space import Space
from remat_search.spec.budget import Share, read_budget
from remat_search.spec.loading import describe_validation_error
from remat_search.spec.space import SpaceConfig
from remat_search.store.attributes import LAYERS_ATTR, STACKS_ATTR
from remat_search.units import format_bytes, format_seconds


class Advice(BaseModel):
    """The plan to use for a budget: the planner's, or the study's fastest measured plan that
    fits where that one is faster (:attr:`source`); with what the study measured of it."""

    model_config = ConfigDict(frozen=True)

    study: str
    budget: int
    plan: RematPlan
    params: dict[str, str]
    """The trial parameters that stand for :attr:`plan` (to queue it in the study)."""
    labels: tuple[str, ...]
    predicted: Prediction | None
    """The model's prediction for :attr:`plan` (None for a measured plan it cannot price)."""
    measured: TrialResult | None
    observations: int
    """How many distinct measured plans the model was fitted to."""
    margin: float
    """The model's calibration margin (see :attr:`CostModel.margin`)."""
    thinned_to: int | None = None
    """None where the plan is the exact optimum of the model; else the front was thinned to
    this many states (see :attr:`Front.thinned_to`) and a faster predicted plan may exist."""
    source: Literal["predicted", "measured"] = "predicted"
    """``predicted``: the model's best plan for the budget; ``measured``: the study's fastest
    measured plan that fits it (what ``best`` answers), which the model's plan does not beat."""
    reason: str | None = None
    """Why a measured plan was advised instead of the model's."""


def plan_for_budget(
    study_name: str, budget: int | str | Share, *, storage: str | None = None, measure: bool = False,
) -> Advice:
    """The planner's advice for ``budget`` on a stored study (:func:`advise`); with
    ``measure``, first measure the advised plan as one more trial of the study unless it was
    measured already (:func:`search.loop.measure_params`). ``budget``: bytes, a size, a share of
    no remat's peak (``70%``) or ``device``, resolved against the study (:func:`budget_bytes`)."""
    read_budget(budget, name="--budget")  # a malformed budget is told before the storage is opened
    with open_study(study_name, storage) as stored:
        limit = budget_bytes(budget, stored, name="--budget")
        if measure and limit > stored.attrs.get("budget", limit):
            raise SpecError(
                f"--budget: {format_bytes(limit)} is above the study's budget of "
                f"{format_bytes(stored.attrs['budget'])}, where plans are not run; "
                "--measure times plans within it"
            )
        advice = advise(stored, limit)
    if measure and advice.measured is None:
        from remat_search.search.loop import measure_params
        from remat_search.store.storage import load_study, open_storage, translate_errors

        opened_storage = open_storage(storage)
        with translate_errors(opened_storage.url):
            study = load_study(study_name, opened_storage)
        report = measure_params(study, opened_storage.url, advice.params)
        advice = advice.model_copy(update={"measured": measured_trial(report.trials, advice.plan)})
    return advice


def advise(study: StoredStudy, budget: int) -> Advice:
    """The fastest plan the study's cost model predicts to fit ``budget``, unless the study's
    fastest measured plan that fits (:meth:`StudyReport.best`) is faster than it (than its
    measurement where it was measured, else its prediction) or no plan is predicted to fit:
    then that measured plan. The advice is never worse than the best measured plan.

    Raises :class:`SpecError` for a study of configurations (the model prices plans at one
    batch and mesh); :class:`StorageError` for a study whose stored search space does not validate;
    :class:`NoFeasiblePlan` while the study cannot fit a model (it needs the uniform presets
    of two choices compiled and one plan timed), or when no plan is predicted to fit and no
    measured one fits.
    """
    if study.searches_configurations:
        raise SpecError(
            f"study: {study.name!r} searches configurations, which the planner's cost model does not "
            "price yet (it prices plans at one batch and mesh); `best --budget` answers from what it measured"
        )
    model, space = _model(study)
    if model is None:
        raise NoFeasiblePlan(
            f"study: {study.name!r} has too little measured to plan from (it needs the uniform "
            "plans of two choices compiled and one plan timed); run its search first"
        )
    try:
        fastest: TrialResult | None = study.best(budget)
    except NoFeasiblePlan:
        fastest = None
    fitting = model.fitting(budget)
    best = fitting.plans[-1] if fitting.plans else None
    if best is None:
        smallest = model.front()[0]
        unpredicted = (
            f"no plan is predicted to fit {format_bytes(budget)} with the model's calibration "
            f"margin of {model.margin:.1%}; the smallest predicted peak is {format_bytes(int(smallest.peak))} "
            f"({collapse_runs(smallest.choices)})"
        )
        if fastest is None:
            raise NoFeasiblePlan(f"budget: {unpredicted}; `best` answers from measured plans only")
        reason = f"{unpredicted}, but {_described(fastest)} fits"
        return _measured_advice(study, budget, model, space, fastest, reason)
    params = space.params(best.choices)
    plan = space.plan(params)
    advice = Advice(
        study=study.name, budget=budget, plan=plan, params=params,
        labels=space.layer_labels(params), predicted=best, measured=measured_trial(study.with_plan(plan.to_json()), plan),
        observations=model.observations, margin=model.margin, thinned_to=fitting.thinned_to,
    )
    if fastest is None or fastest.plan == plan or fastest.seconds is None:
        return advice
    seconds, how = _expected_seconds(advice)
    if fastest.seconds >= seconds:
        return advice
    return _measured_advice(study, budget, model, space, fastest, (
        f"{_described(fastest)} is faster than the model's plan ({plan.summary(advice.labels)}, {how})"
    ))


def _model(study: StoredStudy) -> tuple[CostModel | None, Space]:
    """The study's cost model and search space: the model the search kept where it was fitted
    to the complete trials the study holds (:func:`kept_cost_model`: nothing else is read),
    else fitted here to every complete trial."""
    layers = study.attrs.get(LAYERS_ATTR)
    kept = kept_cost_model(study.attrs, study.count().get("COMPLETE", 0))
    if kept is not None and layers:
        return kept, _stored_space(study, layers)
    trials = study.trials()
    layers = layers or next((len(t.plan.layers) for t in trials if t.plan), 0)
    space = _stored_space(study, layers)
    if not layers:
        return None, space
    params = study.params(state="COMPLETE")
    return cost_model(((t, params[t.number]) for t in trials if t.number in params), space), space


def _stored_space(study: StoredStudy, layers: int) -> Space:
    """The search space the study was made with, over ``layers`` layers; a
    :class:`StorageError` if it has none, or one that no longer validates (made by another
    version of remat-search)."""
    stored = study.attrs.get("space")
    if stored is None:
        raise StorageError(
            f"study: {study.name!r} was not made by remat-search (it has no search space stored)"
        )
    try:
        space = Space.of(SpaceConfig.model_validate(stored), max(layers, 1), study.attrs.get(STACKS_ATTR))
    except ValidationError as e:
        raise StorageError(
            f"study: {study.name!r} stores a search space that no longer validates "
            f"({describe_validation_error(e, prefix='space')}); search again under a new study name"
        ) from None
    return space.with_tensor_bytes((study.attrs.get("device_info") or {}).get("traced_bytes"))


def _expected_seconds(advice: Advice) -> tuple[float, str]:
    """The advised plan's step time as the study knows it (its measurement where it has one,
    else the prediction), and how it knows it; infinite where it was measured over the budget."""
    m, predicted = advice.measured, advice.predicted
    assert predicted is not None
    if m is not None and m.peak_bytes is not None and m.peak_bytes > advice.budget:
        return math.inf, f"trial {m.number}, measured over the budget at {format_bytes(m.peak_bytes)}"
    if m is not None and m.status == "measured" and m.seconds is not None:
        return m.seconds, f"trial {m.number}, measured at {format_seconds(m.seconds)}"
    return predicted.seconds, f"predicted at {format_seconds(predicted.seconds)}"


def _described(t: TrialResult) -> str:
    assert t.peak_bytes is not None and t.seconds is not None
    seconds, peak = format_seconds(t.seconds), format_bytes(t.peak_bytes)
    return f"trial {t.number} ({t.summary()}) measured {seconds} at {peak}"


def _measured_advice(
    study: StoredStudy, budget: int, model: CostModel, space: Space, trial: TrialResult, reason: str
) -> Advice:
    """Advice of the measured ``trial``, priced by the model where it can be."""
    assert trial.plan is not None
    params = {name: str(value) for name, value in study.params(numbers=[trial.number])[trial.number].items()}
    choices = space.choices(params)
    return Advice(
        study=study.name, budget=budget, plan=trial.plan, params=params, labels=trial.labels,
        predicted=model.predict(choices) if choices is not None else None, measured=trial,
        observations=model.observations, margin=model.margin, source="measured", reason=reason,
    )


def measured_trial(trials: Sequence[TrialResult], plan: RematPlan) -> TrialResult | None:
    """The study's first trial that compiled ``plan``."""
    return next(
        (t for t in trials if t.plan == plan and t.status in ("measured", "over_budget") and t.reused_from is None),
        None,
    )
