"""Which running trials are alive: heartbeats for a study shared by several processes or hosts,
and the recovery of trials whose process died.

A search marks each trial it runs with its host (:func:`store.host_name`), process id and the
process's start time, and records a heartbeat of it in optuna's ``trial_heartbeats`` table every
``heartbeat.interval`` seconds (:class:`Heartbeats`). A running trial is dead when:

- its process is gone from this host (found at once, by process id: a search restarted after
  ``kill -9`` takes its trials back without waiting), or
- it has had no heartbeat for ``heartbeat.grace`` seconds (any host: optuna's own
  :func:`optuna.storages.fail_stale_trials`, which process ids cannot do across hosts). A trial
  asked for but never beaten (its process killed between optuna's ``ask`` and its first
  heartbeat) is given a heartbeat by the first search that sees it, so it too is judged by it.

No host's clock or time zone decides anything: heartbeats are the database's time (optuna
writes ``now()`` of the database and compares with it), and the order in which trials were
admitted (:func:`admitted`) is the order of their first heartbeats' rows.

:func:`recover` fails each dead trial once, whichever process finds it first, queues its
plan again and says so (the ``remat_search`` logger). A failed trial counts towards
``spec.trials`` only where the runner failed it (it has a reason): one that died is not
counted, and its plan is measured again.
"""

from __future__ import annotations

import logging
import threading
import warnings
from typing import Self

import optuna
import psutil
import sqlalchemy
from optuna.trial import FrozenTrial, TrialState

from remat_search.spec.models import HeartbeatConfig
from remat_search.store.attributes import (
    FAILURE_ATTR,
    HOST_ATTR,
    INTERRUPTED,
    MOVED,
    PID_ATTR,
    QUEUED_ATTR,
    STARTED_ATTR,
    host_name,
)

logger = logging.getLogger("remat_search")


def mark(trial: optuna.Trial) -> None:
    """Mark ``trial`` as run by this process on this host (see :func:`orphaned`)."""
    me = psutil.Process()
    trial.set_user_attr(HOST_ATTR, host_name())
    trial.set_user_attr(PID_ATTR, me.pid)
    trial.set_user_attr(STARTED_ATTR, me.create_time())


def orphaned(trial: FrozenTrial) -> bool:
    """Whether running ``trial`` is certainly dead without asking its heartbeat: it was marked
    by a process of this host, and that process is gone. A trial of another host, or one not
    marked yet, is judged by its heartbeat."""
    attrs = trial.user_attrs
    if attrs.get(HOST_ATTR) != host_name() or PID_ATTR not in attrs:
        return False
    try:
        return psutil.Process(attrs[PID_ATTR]).create_time() != attrs.get(STARTED_ATTR)
    except psutil.NoSuchProcess:
        return True


def ask(study: optuna.Study) -> optuna.Trial:
    """``study.ask()``, without optuna's warning that heartbeats are meant for
    ``Study.optimize``: this search beats for its own trials (:class:`Heartbeats`)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
        return study.ask()


def recover(study: optuna.Study, storage: optuna.storages.RDBStorage, *, n_params: int) -> None:
    """Fail the study's dead running trials (see the module), queue their plans again, and say
    which (a warning of the ``remat_search`` logger). Safe to call from several processes at
    once: a trial is failed, and its plan queued, by one of them."""
    study_id = storage.get_study_id_from_name(study.study_name)
    for trial_id, beat in _running(storage, study_id).values():
        if beat is None:  # never beaten: its staleness counts from now, by the database's clock
            storage.record_heartbeat(trial_id)
    with warnings.catch_warnings():  # "experimental" since optuna 2.9, and unchanged since
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)  # heartbeats: requeued by the storage's callback
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if orphaned(trial) and fail_and_requeue(study, storage, trial, n_params=n_params):
            logger.warning(
                "note: trial %d of study %r was measured by process %s of this host, which is gone: "
                "failed as interrupted, and %s", trial.number, study.study_name, trial.user_attrs[PID_ATTR],
                "its plan queued again" if _chosen(trial, n_params) else "it had chosen no plan yet",
            )


def admitted(study: optuna.Study, storage: optuna.storages.RDBStorage, trial_id: int, *, trials: int) -> bool:
    """Whether running trial ``trial_id`` (its heartbeat recorded once) is within ``trials``:
    the trials that count (:func:`counts`) and the running ones admitted before it leave room.

    Trials are admitted in the order of their heartbeats' rows, which the database numbers as
    they are inserted: no host's clock takes part. A running trial with no heartbeat yet counts
    as before it (its process may be about to ask the same question): two trials asked for at
    once may both be refused, never both admitted."""
    running = _running(storage, storage.get_study_id_from_name(study.study_name))  # before the counted ones
    mine = next(beat for tid, beat in running.values() if tid == trial_id)
    ahead = {number for number, (tid, beat) in running.items() if tid != trial_id and (beat is None or beat < mine)}
    ahead |= {t.number for t in study.get_trials(deepcopy=False) if counts(t)}
    return len(ahead) < trials


def _running(storage: optuna.storages.RDBStorage, study_id: int) -> dict[int, tuple[int, int | None]]:
    """The study's running trials: number → (trial id, the row id of its heartbeat or None)."""
    with storage.engine.connect() as connection:
        rows = connection.execute(sqlalchemy.text(
            "SELECT t.number, t.trial_id, h.trial_heartbeat_id FROM trials t "
            "LEFT JOIN trial_heartbeats h ON h.trial_id = t.trial_id "
            "WHERE t.study_id = :study AND t.state = 'RUNNING'"
        ), {"study": study_id}).all()
    return {number: (trial_id, beat) for number, trial_id, beat in rows}


def fail_and_requeue(
    study: optuna.Study, storage: optuna.storages.RDBStorage, trial: FrozenTrial, *, n_params: int
) -> bool:
    """Fail running ``trial`` of ``study`` (in ``storage``) as interrupted and queue its plan
    again (if it had chosen all ``n_params``); False where another process finished or failed
    it first."""
    trial_id = storage.get_trial_id_from_study_id_trial_number(
        storage.get_study_id_from_name(study.study_name), trial.number
    )
    try:
        storage.set_trial_user_attr(trial_id, FAILURE_ATTR, INTERRUPTED)
        if not storage.set_trial_state_values(trial_id, state=TrialState.FAIL):
            return False
    except optuna.exceptions.UpdateFinishedTrialError:
        return False
    requeue(study, trial, n_params=n_params)
    return True


def requeue(study: optuna.Study, trial: FrozenTrial, *, n_params: int) -> None:
    """Queue ``trial``'s plan again where it had chosen all ``n_params`` (a queued preset's
    parameters, or those sampled)."""
    if _chosen(trial, n_params):
        enqueue(study, trial.user_attrs.get(QUEUED_ATTR) or trial.params)


def _chosen(trial: FrozenTrial, n_params: int) -> bool:
    """Whether ``trial`` had chosen all ``n_params`` of its plan (queued, or sampled)."""
    return len(trial.user_attrs.get(QUEUED_ATTR) or trial.params) == n_params


def enqueue(study: optuna.Study, params: dict) -> None:
    """Queue a plan's parameters, recorded as queued (:data:`store.QUEUED_ATTR`)."""
    study.enqueue_trial(params, user_attrs={QUEUED_ATTR: params})


def stale_callback(n_params: int):
    """The storage's callback for a trial that optuna failed for its stale heartbeat: queue its
    plan again (the trial is failed already, and counts for nothing: it has no reason)."""

    def requeue_stale(study: optuna.Study, trial: FrozenTrial) -> None:
        logger.warning(
            "note: trial %d of study %r lost its heartbeat (its process or host died): failed, and %s",
            trial.number, study.study_name,
            "its plan queued again" if _chosen(trial, n_params) else "it had chosen no plan yet",
        )
        requeue(study, trial, n_params=n_params)

    return requeue_stale


def counts(trial: FrozenTrial) -> bool:
    """Whether ``trial`` counts towards ``spec.trials``: complete, screened out (pruned), or
    failed by the runner, with a reason. A trial that died, was interrupted or was moved does not."""
    if trial.state in (TrialState.COMPLETE, TrialState.PRUNED):
        return True
    reason = trial.user_attrs.get(FAILURE_ATTR)
    return trial.state == TrialState.FAIL and reason not in (None, INTERRUPTED, MOVED)


def finished_trials(study: optuna.Study) -> int:
    """Trials of ``study`` that count towards ``spec.trials`` (:func:`counts`): complete,
    screened out (pruned), or failed by the runner."""
    states = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
    return sum(1 for t in study.get_trials(deepcopy=False, states=states) if counts(t))


class Heartbeats:
    """Records a heartbeat of every trial this process runs, every ``config.interval`` seconds,
    from a thread of its own (a worker busy compiling for minutes does not stop it)."""

    def __init__(self, storage: optuna.storages.RDBStorage, config: HeartbeatConfig) -> None:
        self._rdb, self._interval = storage, config.interval
        self._trials: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="remat-search-heartbeat", daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def add(self, trial_id: int) -> None:
        """Beat for ``trial_id`` from now on (one heartbeat now)."""
        self._rdb.record_heartbeat(trial_id)
        with self._lock:
            self._trials.add(trial_id)

    def remove(self, trial_id: int) -> None:
        with self._lock:
            self._trials.discard(trial_id)

    def _beat(self) -> None:
        while not self._stop.wait(self._interval):
            with self._lock:
                trials = sorted(self._trials)
            for trial_id in trials:
                try:
                    self._rdb.record_heartbeat(trial_id)
                except Exception as e:  # noqa: BLE001 - a missed beat is retried; the grace allows several
                    logger.warning("could not record the heartbeat of a trial (%s); retrying", e)


def heartbeat_storage_options(config: HeartbeatConfig, n_params: int) -> dict:
    """Keyword arguments that turn on optuna's heartbeat in :class:`RDBStorage`."""
    return {
        "heartbeat_interval": config.interval, "grace_period": config.grace,
        "heartbeat_stale_trial_callback": stale_callback(n_params),
    }
