"""Asking for the next trial of a search: only while the study has room for it.

Proposals are made one at a time, under the search's lock (each sampler sees the plans in
flight: the planner proposes none twice, TPE lies about the running ones), and a trial is
asked for only while finished plus running trials, over every process that searches the
study, are fewer than ``spec.trials`` (:func:`liveness.admitted`); so a study ends with
exactly that many, whatever the workers and hosts.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import optuna
from optuna.trial import TrialState

from remat_search.plans.plan import RematPlan
from remat_search.search.samplers import record_prediction, refused_configurations
from remat_search.search.space import CONFIGURATION_PARAM
from remat_search.search.state import SearchState
from remat_search.store.liveness import admitted, ask, counts, enqueue, mark
from remat_search.store.attributes import FAILURE_ATTR, LABELS_ATTR, MOVED, MOVED_TO_ATTR, PLAN_ATTR, QUEUED_ATTR

WAIT = "wait"
"""What :func:`next_trial` answers while the remaining trials are all running elsewhere."""


class Asked(NamedTuple):
    """A trial admitted, with the plan it proposes."""

    trial: optuna.Trial
    plan: RematPlan
    labels: tuple[str, ...]
    done: int
    """Trials finished when it was asked for."""


def next_trial(search: SearchState) -> Asked | Literal["wait"] | None:
    """The next trial of ``search`` with its plan; :data:`WAIT` while the trials still to
    finish are all running; None when the study is done. The admitted trial is marked as
    this process's (:func:`liveness.mark`) and beaten for from now on."""
    with search.lock:
        search.recover_if_due()
        trials = search.study.get_trials(deepcopy=False)
        done = sum(1 for t in trials if counts(t))
        if done >= search.spec.trials:
            return None
        if done + sum(1 for t in trials if t.state == TrialState.RUNNING) >= search.spec.trials:
            return WAIT
        trial = _ask_past_refused(search, trials)
        try:
            search.heartbeats.add(search.trial_id(trial))  # its first heartbeat: its place in the order of admission
            if not admitted(search.study, search.storage, search.trial_id(trial), trials=search.spec.trials):
                search.interrupt(trial)  # another process asked for the last one at the same moment
                return WAIT
            mark(trial)
            plan = search.space.suggest(trial)
            record_prediction(search.study, trial)
            labels = search.space.layer_labels(trial.params)
            trial.set_user_attr(PLAN_ATTR, plan.to_json())
            trial.set_user_attr(LABELS_ATTR, list(labels))
        except BaseException:
            search.interrupt(trial)
            raise
        return Asked(trial, plan, labels, done)


def _ask_past_refused(search: SearchState, trials: list[optuna.trial.FrozenTrial]) -> optuna.Trial:
    """``ask``, where the workload has refused a configuration (an infeasible trial: MaxText
    refuses a mesh) and others remain: a plan queued at a refused one (a preset: they are queued
    at the first configuration listed) is queued again at the first configuration not refused,
    and the trial that took it is failed as :data:`~store.attributes.MOVED`, counted for nothing.
    The refused queued plans themselves are queued again there too. Else a refused first mesh
    would spend every preset on a refusal, and no preset would ever run."""
    refused = refused_configurations(trials) if search.space.configurations else set()
    accepted = [label for label in search.space.configuration_labels if label not in refused]
    if not refused or not accepted:
        return ask(search.study)
    taken = [t.user_attrs.get(QUEUED_ATTR) or t.params for t in trials if t.user_attrs.get(FAILURE_ATTR) != MOVED]

    def queue_again(queued: dict) -> str:
        moved = {**queued, CONFIGURATION_PARAM: accepted[0]}
        if moved not in taken:
            enqueue(search.study, moved)
            taken.append(moved)
        return accepted[0]

    for t in trials:
        if (queued := t.user_attrs.get(QUEUED_ATTR)) and queued.get(CONFIGURATION_PARAM) in refused and t.state != TrialState.WAITING:
            queue_again(queued)
    while (trial := ask(search.study)).user_attrs.get(QUEUED_ATTR, {}).get(CONFIGURATION_PARAM) in refused:
        queued = trial.user_attrs[QUEUED_ATTR]
        trial.set_user_attr(PLAN_ATTR, search.space.plan(queued).to_json())
        trial.set_user_attr(MOVED_TO_ATTR, queue_again(queued))
        trial.set_user_attr(FAILURE_ATTR, MOVED)
        search.study.tell(trial, state=TrialState.FAIL)
    return trial
