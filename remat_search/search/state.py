"""What the worker threads of one search share: the study and its storage, one lock, the
stop signal, the heartbeats of the trials in hand, and putting a trial back.

A search measures with several worker processes at once, each driven by a thread of the
searching process (:mod:`search.workers`). The threads share one :class:`SearchState`: they
propose and count trials one at a time under its ``lock`` (:mod:`search.admission`), stop
together when ``stop`` is set, and beat for their trials through its ``heartbeats``.
"""

from __future__ import annotations

import threading
import time

import optuna

from remat_search.measure.device import DeviceInfo
from remat_search.search.progress import ProgressCallback
from remat_search.search.space import Space
from remat_search.spec.models import SearchSpec
from remat_search.store.liveness import Heartbeats, fail_and_requeue, recover

POLL_SECONDS = 1.0
"""How often a waiting worker's thread looks again: for a trial to finish, or a claim to go."""


class Stopped(Exception):
    """The search is stopping (Ctrl-C, or another worker's thread failed)."""


class SearchState:
    """One search of ``study`` by this process: ``spec`` within ``budget`` on ``device``,
    proposing plans of ``space``, telling its progress to ``tell``."""

    def __init__(
        self, spec: SearchSpec, budget: int, study: optuna.Study, space: Space,
        storage: optuna.storages.RDBStorage, device: DeviceInfo, tell: ProgressCallback,
    ) -> None:
        self.spec, self.budget, self.study, self.space = spec, budget, study, space
        self.storage, self.engine, self.device, self.tell = storage, storage.engine, device, tell
        self.study_id = storage.get_study_id_from_name(study.study_name)
        self.lock = threading.Lock()
        """Held while a plan is proposed and the trials are counted: one thread at a time."""
        self.stop = threading.Event()
        self.heartbeats = Heartbeats(storage, spec.heartbeat)
        self._recovered = time.monotonic()

    def trial_id(self, trial: optuna.Trial) -> int:
        """The storage's id of this search's ``trial`` (optuna keeps its own private)."""
        return self.storage.get_trial_id_from_study_id_trial_number(self.study_id, trial.number)

    def interrupt(self, trial: optuna.Trial) -> None:
        """Fail this process's ``trial`` as interrupted, and queue its plan again."""
        self.heartbeats.remove(self.trial_id(trial))
        frozen = self.storage.get_trial(self.trial_id(trial))
        fail_and_requeue(self.study, self.storage, frozen, n_params=self.space.n_params)

    def recover_if_due(self) -> None:
        """Fail dead trials (and requeue their plans) once every heartbeat interval; the lock held."""
        if time.monotonic() - self._recovered >= self.spec.heartbeat.interval:
            recover(self.study, self.storage, n_params=self.space.n_params)
            self._recovered = time.monotonic()
