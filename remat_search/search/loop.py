"""The search loop: spec → plans → measurements → an optuna study that survives crashes.

:func:`run` checks everything a spec names before it writes anything, opens its study
(:mod:`search.opening`), then its workers ask optuna for plans until the study holds
``spec.trials`` finished trials (:mod:`search.workers`); it keeps the planner's cost model
fitted to them for ``plan`` (:func:`search.cost_model.keep_cost_model`) and confirms the
fastest (:mod:`search.confirm`). Each trial carries two objectives (median step seconds,
peak bytes) and the budget as a constraint (:mod:`search.recording`). Running the same spec
again resumes: trials left running by a killed search are failed and their plans queued again.
"""

from __future__ import annotations

import contextlib

import optuna
from optuna.trial import TrialState

from remat_search.errors import NoFeasiblePlan, RematSearchError, RunError
from remat_search.report.results import StudyReport, study_report
from remat_search.search.confirm import confirm
from remat_search.search.cost_model import keep_cost_model
from remat_search.search.opening import checked, opened
from remat_search.search.progress import Progress, ProgressCallback
from remat_search.search.runners import resolve_workers, runner_for
from remat_search.search.slice import check_slice, lead
from remat_search.measure.slice import SliceMember
from remat_search.search.state import SearchState
from remat_search.search.study import spec_of_study
from remat_search.search.workers import work
from remat_search.spec.models import SearchSpec
from remat_search.store.liveness import enqueue, finished_trials


def run(spec: SearchSpec, *, on_progress: ProgressCallback | None = None, member: SliceMember | None = None) -> StudyReport:
    """Search ``spec`` until its study holds ``spec.trials`` finished trials; return the report.

    ``spec.workers`` worker processes measure plans at once, each driven by a thread of this
    process (see :mod:`search.workers`). ``on_progress`` hears a
    :class:`~remat_search.search.progress.Progress` when the study is open (``start``), before
    and after every trial (``trial``, ``result``) and around the confirmation (``confirm``,
    ``confirmed``), from the workers' threads.

    ``member``: this process's place in a slice, where it leads one (process 0; see
    :mod:`search.slice`): one runner, whose every request the slice's processes measure together.
    """
    tell = on_progress or (lambda _: None)
    spec, space = checked(spec)  # before any work: no worker started, nothing compiled or written
    if member is not None:
        check_slice(spec, member)
    with contextlib.ExitStack() as stack:
        runners = (
            [stack.enter_context(lead(spec, member))] if member is not None
            else [stack.enter_context(runner_for(spec)) for _ in range(resolve_workers(spec.workers))]
        )
        device = runners[0].describe()  # the others start in their threads
        study, storage, budget, space = opened(spec, space, device, runners[0])
        tell(Progress(event="start", done=finished_trials(study), total=spec.trials, device=device, budget=budget))
        work(SearchState(spec, budget, study, space, storage, device, tell), runners)
        keep_cost_model(study, space)  # what `plan` answers from, until the study has more trials
        if spec.confirm.top and device.executes:
            try:
                return confirm(
                    study, runners[0], storage=storage, budget=budget, top=spec.confirm.top,
                    rounds=spec.confirm.rounds, warmup=spec.timing.warmup, presets=spec.confirm.presets,
                    races=spec.confirm.races, heartbeat=spec.heartbeat, on_progress=on_progress,
                )
            except NoFeasiblePlan:
                pass  # nothing ran within the budget: nothing to confirm
            except RematSearchError as e:
                raise RunError(
                    f"{e}; the search's {finished_trials(study)} trials are kept, and "
                    f"`remat-search confirm --study {spec.study}` tries the confirmation again"
                ) from None
        return study_report(study)


def measure_params(study: optuna.Study, storage: str, params: dict[str, str]) -> StudyReport:
    """Measure the plan of ``params`` as one more trial of ``study``, as its last search
    measured (the same worker, cache and budget); return the study's report. Plans the study
    had already queued run first."""
    waiting = len(study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))
    spec = spec_of_study(study, storage, trials=finished_trials(study) + waiting + 1, confirm={"top": 0})
    enqueue(study, params)  # after the plans already queued, which run first
    return run(spec)
