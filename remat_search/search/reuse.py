"""A plan measured once, by whichever search gets to it first: claims, and the measurement
cache from a search's side.

Each plan is claimed before it is measured (:func:`cache.claim`): one measured elsewhere right
now (any study on this database and device) is waited for, then its measurement reused. A
stored measurement that can be judged for this study as it is (:func:`cache.measure_again`)
is judged, not measured again: by the plan's digest (:func:`stored`), or, once compiled, by
its program's (:func:`known`).
"""

from __future__ import annotations

import datetime
from typing import NamedTuple

import optuna
from optuna.trial import TrialState

from remat_search.measure.measurement import Measurement, RawMeasurement, judge
from remat_search.plans.plan import RematPlan
from remat_search.search.state import POLL_SECONDS, SearchState, Stopped
from remat_search.store import cache
from remat_search.store.attributes import CACHED_ATTR, PLAN_ATTR, REUSED_ATTR


def claim(search: SearchState, trial: optuna.Trial, plan: RematPlan) -> None:
    """Claim ``plan`` for ``trial``, waiting while a live trial (of any study on this
    database and device) measures it; a claim whose trial is gone is taken over."""
    while (holder := cache.claim(
        search.engine, search.device, plan.digest, study=search.spec.study, trial=trial.number
    )) is not None:
        if not _running(search.storage, *holder):
            cache.release(search.engine, search.device, plan.digest, study=holder[0], trial=holder[1])
            continue
        if search.stop.wait(POLL_SECONDS):
            raise Stopped
        with search.lock:
            search.recover_if_due()


def release(search: SearchState, trial: optuna.Trial, plan: RematPlan) -> None:
    """Give up ``trial``'s claim of ``plan``."""
    cache.release(search.engine, search.device, plan.digest, study=search.spec.study, trial=trial.number)


def _running(storage: optuna.storages.RDBStorage, study: str, number: int) -> bool:
    """Whether trial ``number`` of ``study`` is running (not finished, failed or gone)."""
    try:
        study_id = storage.get_study_id_from_name(study)
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, number)
        return storage.get_trial(trial_id).state == TrialState.RUNNING
    except KeyError:
        return False


class Reused(NamedTuple):
    """A stored measurement of a trial's plan, judged for this study, and where it is from:
    this study's own trial ``reused_from``, or ``cached_from`` (``study#trial``)."""

    measurement: Measurement | None = None
    reused_from: int | None = None
    cached_from: str | None = None


def stored(search: SearchState, trial: optuna.Trial, plan: RematPlan) -> Reused:
    """The cached measurement of ``plan``, judged as the worker would and recorded on
    ``trial`` as reused; nothing where the plan must be measured."""
    # A plan naming a policy function by its import path is not known by its text: the
    # function's code may have changed since. It is compiled, and reused by its program.
    if any(p.function for p in plan.layers):
        return Reused()
    spec = search.spec
    hit = cache.lookup(search.engine, search.device, plan.digest)
    if hit is None or cache.measure_again(
        hit.raw, budget=search.budget, repeats=spec.timing.repeats, anchored=spec.timing.anchor
    ):
        return Reused()
    m = judge(hit.raw, budget=search.budget, gradient_tolerance=spec.gradient_tolerance)
    if hit.study == spec.study and hit.trial == trial.number and _kept_since_it_started(search, trial, hit):
        # This very trial, measured a moment ago by another search that popped it from the
        # queue at once (optuna's ask races on a queued plan): that search's measurement is
        # the trial's own, so it carries no mark of reuse; whichever search records it first wins.
        return Reused(m)
    # this study's own earlier trial; not where a study of the same name was deleted and made
    # again, and the cache's trial is this one
    if hit.study == spec.study and hit.trial != trial.number and _plan_of(search.study, hit.trial) == plan.digest:
        trial.set_user_attr(REUSED_ATTR, hit.trial)
        return Reused(m, reused_from=hit.trial)
    cached_from = f"{hit.study}#{hit.trial}"
    trial.set_user_attr(CACHED_ATTR, cached_from)
    return Reused(m, cached_from=cached_from)


def _kept_since_it_started(search: SearchState, trial: optuna.Trial, hit: cache.Cached) -> bool:
    """Whether ``hit`` was kept after ``trial`` started (by another search that ran it too), not
    by a study of the same name deleted and made again."""
    started = search.storage.get_trial(search.trial_id(trial)).datetime_start
    if hit.created is None or started is None:
        return False
    return hit.created >= started.astimezone(datetime.UTC).replace(tzinfo=None)  # optuna's: local time, naive


def _plan_of(study: optuna.Study, number: int) -> str | None:
    """The plan digest of trial ``number`` of ``study`` (None if it has none, or no such trial)."""
    for t in study.get_trials(deepcopy=False):
        if t.number == number and PLAN_ATTR in t.user_attrs:
            return RematPlan.model_validate_json(t.user_attrs[PLAN_ATTR]).digest
    return None


def known(search: SearchState, program: str, shared: list[cache.Cached]) -> RawMeasurement | None:
    """A measurement of the compiled ``program`` that can be judged for this study as it
    is (see :func:`cache.measure_again`), or None; one found is added to ``shared``."""
    hit = cache.lookup_program(search.engine, search.device, program)
    if hit is None or cache.measure_again(
        hit.raw, budget=search.budget, repeats=search.spec.timing.repeats, anchored=search.spec.timing.anchor
    ):
        return None
    shared.append(hit)
    return hit.raw


def keep(search: SearchState, trial: optuna.Trial, m: Measurement) -> None:
    """Store ``trial``'s own measurement ``m`` in the cache, for every study to reuse."""
    cache.store(search.engine, search.device, m, study=search.spec.study, trial=trial.number)
