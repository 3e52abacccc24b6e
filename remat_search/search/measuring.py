"""Measuring one admitted trial: its plan claimed, a stored measurement reused or the plan
screened or measured in a worker, the result kept in the cache and recorded in the trial.

If anything interrupts it (Ctrl-C, a worker that cannot restart), the trial is failed as
interrupted and its plan queued again before the error goes on.
"""

from __future__ import annotations

import optuna

from remat_search.measure.measurement import Measurement
from remat_search.measure.runner import Runner
from remat_search.plans.plan import RematPlan
from remat_search.report.results import TrialResult
from remat_search.search import reuse
from remat_search.search.admission import Asked
from remat_search.search.cost_model import study_cost_model
from remat_search.search.progress import Progress
from remat_search.search.recording import anchor_seconds, record
from remat_search.search.space import Space
from remat_search.search.state import SearchState, Stopped
from remat_search.spec.models import SearchSpec
from remat_search.store import cache
from remat_search.store.liveness import finished_trials
from remat_search.store.attributes import PREDICTION_ATTR, SAME_PROGRAM_ATTR


def measure(search: SearchState, asked: Asked, runner: Runner) -> None:
    """Measure the plan of ``asked`` in ``runner``'s worker (or reuse a stored measurement of
    it) and record it, telling ``trial`` before and ``result`` after."""
    trial, plan, labels, done = asked
    spec, study = search.spec, search.study
    same_program = None
    claimed = False
    try:
        reuse.claim(search, trial, plan)
        claimed = True
        m, reused_from, cached_from = reuse.stored(search, trial, plan)
        search.tell(Progress(
            event="trial", done=done, total=spec.trials, trial=TrialResult(
                number=trial.number, status="running", plan=plan, labels=labels, reused_from=reused_from,
                cached_from=cached_from,
            ),
        ))
        shared: list[cache.Cached] = []
        if m is None:
            m = _screened(spec, study, trial, search.space, plan, search.budget) or runner.measure(
                plan, budget=search.budget, timing=spec.timing, gradient_tolerance=spec.gradient_tolerance,
                known=lambda program: reuse.known(search, program, shared),
            )
        if search.stop.is_set():  # its worker was killed to stop the search: not a failure of the plan
            raise Stopped
        if shared and m.same_program_as is not None:
            same_program = f"{shared[-1].study}#{shared[-1].trial}"
            trial.set_user_attr(SAME_PROGRAM_ATTR, same_program)
        if reused_from is None and cached_from is None:
            reuse.keep(search, trial, m)
        with search.lock:  # the study's first anchored measurement sets its reference: one thread
            anchor = anchor_seconds(study, m) if spec.timing.anchor else None
        m = m.model_copy(update={"anchor_seconds": anchor})
        record(study, trial, m, search.budget, search.storage, search.trial_id(trial), plan.configuration)
    except BaseException:
        search.interrupt(trial)
        raise
    finally:
        search.heartbeats.remove(search.trial_id(trial))
        if claimed:
            reuse.release(search, trial, plan)
    search.tell(Progress(
        event="result", done=finished_trials(study), total=spec.trials, trial=TrialResult(
            number=trial.number, status=m.status, plan=plan, measurement=m, labels=labels,
            reused_from=reused_from, cached_from=cached_from, same_program_as=same_program, error=m.error,
        ),
    ))


def _screened(
    spec: SearchSpec, study: optuna.Study, trial: optuna.Trial, space: Space, plan: RematPlan, budget: int
) -> Measurement | None:
    """An over-budget measurement without a compile, where the study's cost model says the
    plan certainly needs more than ``spec.prescreen × budget`` (see
    :meth:`CostModel.certainly_over`); None where the plan must be compiled. The planner's
    own proposals (with a prediction) were chosen to fit by that model: never screened."""
    if spec.prescreen is None or plan.layout != "flat" or PREDICTION_ATTR in trial.user_attrs:
        return None
    model = study_cost_model(study, space)
    choices = space.choices(trial.params)
    prediction = model and choices and model.certainly_over(choices, budget, spec.prescreen)
    if not prediction:
        return None
    return Measurement(status="over_budget", plan_digest=plan.digest, screened_bytes=round(prediction.peak))
