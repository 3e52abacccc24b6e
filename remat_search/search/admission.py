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
from remat_search.search.samplers import record_prediction
from remat_search.search.state import SearchState
from remat_search.store.liveness import admitted, ask, counts, mark
from remat_search.store.attributes import LABELS_ATTR, PLAN_ATTR

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
        trial = ask(search.study)
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
