"""The threads of one search, one per worker process: each asks for a trial
(:mod:`search.admission`), measures it in its worker and records it (:mod:`search.measuring`),
until the study holds ``spec.trials`` finished trials.

Ctrl-C stops them all: every worker is killed, and each thread puts its trial back (failed as
interrupted, its plan queued again) before :func:`work` raises it. The first error of any
thread stops the others the same way and is raised once they have.
"""

from __future__ import annotations

import logging
import threading

import optuna

from remat_search.measure.runner import Runner
from remat_search.search.admission import WAIT, next_trial
from remat_search.search.measuring import measure
from remat_search.search.state import POLL_SECONDS, SearchState, Stopped

logger = logging.getLogger("remat_search")


def work(search: SearchState, runners: list[Runner]) -> None:
    """Measure with every runner until the study of ``search`` is done; raise the first
    thread's error, or KeyboardInterrupt, once every thread has put its trial back."""
    started = threading.Barrier(len(runners))
    ended = [threading.Event() for _ in runners]
    errors: list[BaseException] = []
    threads = [
        threading.Thread(
            target=_work, args=(search, runner, started, end, errors), name=f"remat-search-worker-{i}", daemon=True
        )
        for i, (runner, end) in enumerate(zip(runners, ended, strict=True))
    ]
    with search.heartbeats:
        for thread in threads:
            thread.start()
        try:
            for end in ended:  # not Thread.join: on 3.11 a Ctrl-C inside join() marks a live thread stopped
                while not end.wait(0.2):
                    pass
        except BaseException:  # Ctrl-C: stop the workers; each thread requeues its trial
            search.stop.set()
            started.abort()
            for runner in runners:
                runner.kill()
            for end in ended:
                end.wait()
            raise
    if errors:
        raise errors[0]


def _work(
    search: SearchState, runner: Runner, started: threading.Barrier, ended: threading.Event,
    errors: list[BaseException],
) -> None:
    """One thread: start ``runner``'s worker, then ask, measure and record until done."""
    try:
        try:
            runner.describe()  # every worker starts at once, and all begin together
        finally:
            started.wait()
        while not search.stop.is_set():
            try:
                asked = next_trial(search)
                if asked is None:
                    return
                if asked == WAIT:
                    search.stop.wait(POLL_SECONDS)
                    continue
                measure(search, asked, runner)
            except optuna.exceptions.UpdateFinishedTrialError as e:
                # Another search finished this trial first: it popped the same queued trial
                # (optuna's ask races on a plan queued a moment ago), or judged it dead.
                # The measurement, if any, is in the cache; the study goes on without it.
                logger.warning("note: %s: another search finished it first; going on", e)
    except (Stopped, threading.BrokenBarrierError):
        pass
    except BaseException as e:  # noqa: BLE001 - raised again by work(), in the main thread
        errors.append(e)
        search.stop.set()
    finally:
        ended.set()
