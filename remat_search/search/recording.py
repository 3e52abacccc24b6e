"""Recording a measurement into its trial: the objectives, the budget constraint, the state.

Each trial carries two objectives (median step seconds, per token in a study of
configurations; peak bytes) and the budget as a
constraint (``peak / budget − 1``, feasible when ≤ 0). An anchored step time is the plan's
median ratio to the anchor plan in the study's anchor seconds (:func:`anchor_seconds`), so the
study's times compare across hours.
"""

from __future__ import annotations

import math
import statistics

import optuna
from optuna.trial import TrialState

from remat_search.measure.measurement import Measurement
from remat_search.plans.configuration import Configuration, cost
from remat_search.store.attributes import ANCHOR_ATTR, FAILURE_ATTR, MEASUREMENT_ATTR

CONSTRAINTS_ATTR = "constraints"
"""The trial system attribute of its constraints, in the list form optuna and optuna-dashboard both read."""


def record(
    study: optuna.Study, trial: optuna.Trial, m: Measurement, budget: int,
    storage: optuna.storages.RDBStorage, trial_id: int, configuration: Configuration | None = None,
) -> None:
    """Store a measurement, the budget constraint last, and finish the trial. In a study of
    configurations the first objective is the step time per token each device trains on
    (``configuration``: the plan's; see :func:`~remat_search.plans.configuration.cost`).

    A plan screened out is a prediction, not a measurement: its trial is PRUNED, with no
    objective values, so that nothing that reads the study's objectives (``best_trials``,
    optuna-dashboard) takes it for one. The prediction stays in its measurement attribute
    (``screened_bytes``); its constraint tells the samplers it is certainly over the budget
    (TPE ranks a pruned trial with a violated constraint among the infeasible). A candidate the
    workload refused to build (``infeasible``: MaxText's reason in the measurement) is PRUNED
    the same way, its constraint violated (1.0: it has no peak to state)."""
    trial.set_user_attr(MEASUREMENT_ATTR, m.model_dump_json())
    if m.status == "failed":
        trial.set_user_attr(FAILURE_ATTR, m.error or "unknown failure")
        study.tell(trial, state=TrialState.FAIL)
        return
    if m.status == "infeasible":
        _constrain(1.0, storage, trial_id)
        study.tell(trial, state=TrialState.PRUNED)
        return
    if m.screened_bytes is not None:
        _constrain(m.screened_bytes / budget - 1.0, storage, trial_id)
        study.tell(trial, state=TrialState.PRUNED)
        return
    assert m.peak_bytes is not None
    seconds = cost(m.step_seconds, configuration) if m.status == "measured" else math.inf  # never run: no time
    _constrain(m.peak_bytes / budget - 1.0, storage, trial_id)
    study.tell(trial, [seconds, float(m.peak_bytes)])


def _constrain(value: float, storage: optuna.storages.RDBStorage, trial_id: int) -> None:
    """Record the budget constraint ``value`` as the trial's one constraint, in the list that
    ``constraints_func`` writes: optuna 5 reads it (as constraint ``"0"``), and optuna-dashboard
    reads only that list (not ``Trial.set_constraint``'s named keys)."""
    storage.set_trial_system_attr(trial_id, CONSTRAINTS_ATTR, [value])


def anchor_seconds(study: optuna.Study, m: Measurement) -> float | None:
    """The study's reference time of the anchor plan: the anchor's median in the first
    anchored measurement the study recorded (set by ``m`` where it is that one); None where
    ``m`` timed no anchor. Call it with the search's lock held: one thread sets it."""
    if not m.anchor_times:
        return None
    reference = study.user_attrs.get(ANCHOR_ATTR)
    if reference is None:
        study.set_user_attr(ANCHOR_ATTR, statistics.median(m.anchor_times))
        reference = study.user_attrs[ANCHOR_ATTR]  # another search's, where it set one at the same moment
    return float(reference)
