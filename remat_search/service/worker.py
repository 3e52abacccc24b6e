"""The worker: a long-running process that measures whatever the storage holds unfinished.

``remat-search worker --storage URL`` takes the oldest study with work left (fewer finished
and running trials than its spec's ``trials``) and searches it with :func:`search.loop.run`, the
same code as ``run`` with the same guarantees (exact totals over every host, no plan measured
twice at once, dead trials found by heartbeat), as it was submitted, on this host's devices.
Then the next; when nothing is left it looks again every ``poll`` seconds, or returns
(``until_idle``). A study this host cannot measure (another device measures it, a budget
this device cannot hold, a workload that does not build here) is left to others, said once.

Every trial is told as one event, a flat dict a log line is made of
(:func:`trial_event`): study, trial, plan, status, peak, time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import optuna
from optuna.trial import TrialState

from remat_search.errors import RematSearchError, RunError
from remat_search.report.results import TrialResult
from remat_search.search.loop import run
from remat_search.search.progress import Progress
from remat_search.search.space import Space
from remat_search.search.study import spec_of_submitted
from remat_search.store.liveness import finished_trials, heartbeat_storage_options, recover
from remat_search.store.attributes import LAYERS_ATTR, SPEC_ATTR, STACKS_ATTR
from remat_search.store.storage import open_storage, translate_errors

Event = dict[str, Any]
EventCallback = Callable[[Event], None]
POLL_SECONDS = 5.0
"""How often an idle worker looks for work (``--poll``)."""


def work(
    storage: str, *, workers: int | str = 1, until_idle: bool = False, poll: float = POLL_SECONDS,
    on_event: EventCallback | None = None,
) -> None:
    """Measure the unfinished studies of ``storage`` with ``workers`` worker processes, one
    study at a time, until interrupted (or, with ``until_idle``, until none is left).

    Ctrl-C (KeyboardInterrupt, raised again) fails the trials in hand as interrupted and
    queues their plans again, as ``run`` does; ``on_event`` has heard each as ``measuring``
    with no ``trial`` event after it."""
    tell = on_event or (lambda _: None)
    opened = open_storage(storage, create=True)  # a new, empty database has no studies yet
    left_alone: set[str] = set()
    idle = False
    while True:
        todo = [name for name in unfinished(opened) if name not in left_alone]
        if not todo:
            if until_idle:
                return
            if not idle:
                tell({"event": "idle", "poll_seconds": poll})
                idle = True
            time.sleep(poll)
            continue
        idle = False
        name = todo[0]
        with translate_errors(storage):
            study = optuna.load_study(study_name=name, storage=opened)
            spec = spec_of_submitted(study, storage, workers=workers)
        tell({"event": "study", "study": name, "done": finished_trials(study), "total": spec.trials})
        try:
            report = run(spec, on_progress=lambda p, name=name: _progress(name, p, tell))
        except RematSearchError as e:  # not for this host (its device, budget, workload), or it failed here
            left_alone.add(name)  # once: another worker may measure it; this one would fail it again
            tell({"event": "error" if isinstance(e, RunError) else "left", "study": name, "reason": str(e)})
            continue
        tell({
            "event": "finished", "study": name,
            **{status: report.count(status) for status in ("measured", "over_budget", "failed", "infeasible")},
        })


def unfinished(storage: optuna.storages.RDBStorage) -> list[str]:
    """Studies of ``storage`` that were submitted (have a stored spec) and have work left to
    take: fewer finished plus running trials than their spec's ``trials``, once running trials
    whose process or host died are taken back (:func:`liveness.recover`); oldest first."""
    names = []
    with translate_errors(storage.url):
        summaries = optuna.get_all_study_summaries(storage, include_best_trial=False)
        for summary in sorted(summaries, key=lambda s: storage.get_study_id_from_name(s.study_name)):
            total = summary.user_attrs.get(SPEC_ATTR, {}).get("trials", 0)
            study = optuna.load_study(study_name=summary.study_name, storage=storage)
            done = finished_trials(study)
            if done < total <= done + _running(study):
                _recover(study, storage.url)  # work is left only if a running trial is dead
                study = optuna.load_study(study_name=summary.study_name, storage=storage)
            if done + _running(study) < total:
                names.append(summary.study_name)
    return names


def _running(study: optuna.Study) -> int:
    return len(study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)))


def _recover(study: optuna.Study, storage: str) -> None:
    """Take back ``study``'s dead running trials, with its own heartbeat settings."""
    spec = spec_of_submitted(study, storage)
    space = Space.of(spec.space, study.user_attrs[LAYERS_ATTR], study.user_attrs.get(STACKS_ATTR))
    beating = open_storage(storage, heartbeat=heartbeat_storage_options(spec.heartbeat, space.n_params))
    recover(
        optuna.load_study(study_name=study.study_name, storage=beating), beating, n_params=space.n_params,
    )


def trial_event(study: str, t: TrialResult, done: int, total: int) -> Event:
    """The event (a log line) of a trial of ``study`` just recorded."""
    m = t.measurement
    event: Event = {
        "event": "trial", "time": datetime.now(UTC).isoformat(timespec="seconds"), "study": study,
        "trial": t.number, "plan": t.summary(), "status": t.status, "peak_bytes": t.peak_bytes,
        "seconds": t.seconds, "compile_seconds": m.compile_seconds if m else None, "done": done, "total": total,
    }
    for key in ("reused_from", "cached_from", "same_program_as", "error"):
        if getattr(t, key) is not None:
            event[key] = getattr(t, key)
    return event


def _progress(study: str, p: Progress, tell: EventCallback) -> None:
    if p.event == "trial" and p.trial is not None:
        tell({"event": "measuring", "study": study, "trial": p.trial.number, "plan": p.trial.summary()})
    elif p.event == "result" and p.trial is not None:
        tell(trial_event(study, p.trial, p.done, p.total))
    elif p.event == "confirm":
        tell({"event": "confirm", "study": study, "plans": p.plans, "rounds": p.rounds, "race": p.race})
    elif p.event == "confirmed":
        tell({
            "event": "confirmed", "study": study, "plans": p.plans, "rounds": p.rounds, "reused": p.reused,
            "races": p.race, "exhausted": p.exhausted,
        })
    elif p.event == "confirm_elsewhere":
        tell({"event": "confirm_elsewhere", "study": study, "holder": p.holder})
