"""The search loop: spec → plans → measurements → an optuna study that survives crashes.

:func:`run` checks everything a spec names before it writes anything, then asks optuna
for plans until the study holds ``spec.trials`` finished trials. Each trial carries two
objectives (median step seconds, peak bytes) and the budget as a constraint
(``peak / budget − 1``, feasible when ≤ 0). Running the same spec again resumes: trials
left running by a killed search are failed and their plans queued again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import statistics
import threading
import time
from typing import Any, Literal, NamedTuple

import optuna
from optuna.trial import TrialState

from remat_search.store import cache
from remat_search.search.confirm import confirm
from remat_search.errors import NoFeasiblePlan, RematSearchError, RunError, SpecError
from remat_search.store.liveness import (
    Heartbeats,
    admitted,
    ask,
    counts,
    enqueue,
    fail_and_requeue,
    heartbeat_storage_options,
    mark,
    recover,
)
from remat_search.measure.measurement import Measurement, RawMeasurement, judge
from remat_search.plans.plan import RematPlan
from remat_search.search.planner import (
    Advice,
    advise,
    make_sampler,
    measured_trial,
    record_prediction,
    study_cost_model,
)
from remat_search.report.results import StudyReport, TrialResult, study_report
from remat_search.measure.runner import DeviceInfo, Runner
from remat_search.search.space import Space
from remat_search.spec.models import SearchSpec
from remat_search.store.storage import (
    ANCHOR_ATTR,
    CACHED_ATTR,
    FAILURE_ATTR,
    LABELS_ATTR,
    MEASUREMENT_ATTR,
    PLAN_ATTR,
    PREDICTION_ATTR,
    REUSED_ATTR,
    SAME_PROGRAM_ATTR,
    check_storage,
    load_study,
    open_storage,
    translate_errors,
)
from remat_search.search.study import (
    DEVICE_IDENTITY,
    FIXED_SETTINGS,
    IDENTITY_FIELDS,
    SETTINGS_ATTR,
    SETTINGS_FIELDS,
    Progress,
    ProgressCallback,
    as_written_now,
    changed_settings,
    finished_trials,
    identity_error,
    resolve_budget,
    resolve_workers,
    runner_for,
    spec_of_study,
)
from remat_search.search.submission import (
    check,
    check_identity,
    load_or_create,
    prepare,
    refuse_another_identity,
    resumed_as_stored,
)
from remat_search.units import format_bytes

logger = logging.getLogger("remat_search")
CONSTRAINTS_ATTR = "constraints"
"""The trial system attribute of its constraints, in the list form optuna and optuna-dashboard both read."""
INITIALIZED_ATTR = "initialized"

def run(spec: SearchSpec, *, on_progress: ProgressCallback | None = None) -> StudyReport:
    """Search ``spec`` until its study holds ``spec.trials`` finished trials; return the report.

    ``spec.workers`` worker processes measure plans at once, each driven by a thread of this
    process (see :class:`_Workers`). ``on_progress`` hears a
    :class:`~remat_search.search.study.Progress` when the study is open (``start``), before and after
    every trial (``trial``, ``result``) and around the confirmation (``confirm``,
    ``confirmed``), from the workers' threads.
    """
    tell = on_progress or (lambda _: None)
    check_storage(spec.storage, create=True)  # fail fast, before the worker starts
    spec = resumed_as_stored(spec)  # an older spec resumes its study as it was searched
    refuse_another_identity(spec)  # before any work: no worker started, nothing compiled or written
    space = check(spec)
    with contextlib.ExitStack() as stack:
        runners = [stack.enter_context(runner_for(spec)) for _ in range(resolve_workers(spec.workers))]
        device = runners[0].describe()  # the others start in their threads
        _warn_untagged(spec, device)
        offload = [c.label for c in spec.space.choices if c.policy.host_memory]
        if offload and device.platform == "cpu":
            raise SpecError(
                f"spec.space.choices: {offload} offload to host memory, which needs a GPU or TPU; "
                "this machine compiles for cpu"
            )
        budget = resolve_budget(spec.budget, device)
        storage = open_storage(
            spec.storage, create=True, heartbeat=heartbeat_storage_options(spec.heartbeat, space.n_params)
        )
        with translate_errors(spec.storage):  # the storage calls that open the study; later ones fail at run time
            cache.create_table(storage.engine)
            study = _open_study(spec, budget, storage, device, space)
            recover(study, storage, n_params=space.n_params)
        tell(Progress(event="start", done=finished_trials(study), total=spec.trials, device=device, budget=budget))
        _Workers(spec, budget, study, space, storage, device, tell).run(runners)
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


def _warn_untagged(spec: SearchSpec, device: DeviceInfo) -> None:
    """Say which choices name tensors the traced step never tags (a model's tags may depend on
    its configuration): for those names such a choice saves nothing."""
    if device.traced_names is None:
        return
    for choice in spec.space.choices:
        missing = sorted(set(choice.policy.tensor_names) - set(device.traced_names))
        if missing:
            logger.warning(
                "note: spec.space.choices: %r names %s, which the traced step never tags with checkpoint_name "
                "(it tags %s): for those, the choice saves nothing", choice.label, missing,
                ", ".join(device.traced_names) or "nothing",
            )


class _Stopped(Exception):
    """The search is stopping (Ctrl-C, or another worker's thread failed)."""


class _Asked(NamedTuple):
    trial: optuna.Trial
    plan: RematPlan
    labels: tuple[str, ...]
    done: int
    """Trials finished when it was asked for."""


_WAIT = "wait"
"""What :meth:`_Workers.next` answers while the remaining trials are all running elsewhere."""
POLL_SECONDS = 1.0
"""How often a waiting worker's thread looks again: for a trial to finish, or a claim to go."""


class _Workers:
    """The threads of one search, one per worker process: each asks optuna for a plan, measures
    it in its worker and records it, until the study holds ``spec.trials`` finished trials.

    Proposals are made one at a time (each sampler sees the plans in flight: the planner
    proposes none twice, TPE lies about the running ones), and a trial is asked for only while
    finished plus running trials, over every process that searches the study, are fewer than
    ``spec.trials``; so a study ends with exactly that many, whatever the workers and hosts.
    Each plan is claimed before it is measured (:func:`cache.claim`): one measured elsewhere
    right now is waited for, then its measurement reused. Dead trials, of this host or
    another, are failed and their plans queued again (:func:`liveness.recover`).
    """

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
        self.errors: list[BaseException] = []
        self.heartbeats = Heartbeats(storage, spec.heartbeat)
        self.recovered = time.monotonic()

    def run(self, runners: list[Runner]) -> None:
        """Measure with every runner until the study is done; raise the first thread's error,
        or KeyboardInterrupt, once every thread has put its trial back."""
        started = threading.Barrier(len(runners))
        ended = [threading.Event() for _ in runners]
        threads = [
            threading.Thread(
                target=self._work, args=(runner, started, end), name=f"remat-search-worker-{i}", daemon=True
            )
            for i, (runner, end) in enumerate(zip(runners, ended, strict=True))
        ]
        with self.heartbeats:
            for thread in threads:
                thread.start()
            try:
                for end in ended:  # not Thread.join: on 3.11 a Ctrl-C inside join() marks a live thread stopped
                    while not end.wait(0.2):
                        pass
            except BaseException:  # Ctrl-C: stop the workers; each thread requeues its trial
                self.stop.set()
                started.abort()
                for runner in runners:
                    runner.kill()
                for end in ended:
                    end.wait()
                raise
        if self.errors:
            raise self.errors[0]

    def _work(self, runner: Runner, started: threading.Barrier, ended: threading.Event) -> None:
        try:
            try:
                runner.describe()  # every worker starts at once, and all begin together
            finally:
                started.wait()
            while not self.stop.is_set():
                try:
                    asked = self.next()
                    if asked is None:
                        return
                    if asked == _WAIT:
                        self.stop.wait(POLL_SECONDS)
                        continue
                    self.measure(asked, runner)
                except optuna.exceptions.UpdateFinishedTrialError as e:
                    # Another search finished this trial first: it popped the same queued trial
                    # (optuna's ask races on a plan queued a moment ago), or judged it dead.
                    # The measurement, if any, is in the cache; the study goes on without it.
                    logger.warning("note: %s: another search finished it first; going on", e)
        except (_Stopped, threading.BrokenBarrierError):
            pass
        except BaseException as e:  # noqa: BLE001 - raised again by run(), in the main thread
            self.errors.append(e)
            self.stop.set()
        finally:
            ended.set()

    def next(self) -> _Asked | Literal["wait"] | None:
        """The next trial with its plan; ``_WAIT`` while the trials still to finish are all
        running; None when the study is done."""
        with self.lock:
            self._recover_if_due()
            trials = self.study.get_trials(deepcopy=False)
            done = sum(1 for t in trials if counts(t))
            if done >= self.spec.trials:
                return None
            if done + sum(1 for t in trials if t.state == TrialState.RUNNING) >= self.spec.trials:
                return _WAIT
            trial = ask(self.study)
            try:
                self.heartbeats.add(self._id_of(trial))  # its first heartbeat: its place in the order of admission
                if not admitted(self.study, self.storage, self._id_of(trial), trials=self.spec.trials):
                    self._interrupt(trial)  # another process asked for the last one at the same moment
                    return _WAIT
                mark(trial)
                plan = self.space.suggest(trial)
                record_prediction(self.study, trial)
                labels = self.space.layer_labels(trial.params)
                trial.set_user_attr(PLAN_ATTR, plan.to_json())
                trial.set_user_attr(LABELS_ATTR, list(labels))
            except BaseException:
                self._interrupt(trial)
                raise
            return _Asked(trial, plan, labels, done)

    def measure(self, asked: _Asked, runner: Runner) -> None:
        """Measure the plan of ``asked`` (or reuse a cached measurement of it) and record it.

        If anything interrupts it (Ctrl-C, a worker that cannot restart), the trial is failed
        as interrupted and its plan queued again before the error goes on."""
        trial, plan, labels, done = asked
        spec, study = self.spec, self.study
        reused_from = cached_from = same_program = None
        m: Measurement | None = None
        claimed = False
        try:
            self._claim(trial, plan)
            claimed = True
            # A plan naming a policy function by its import path is not known by its text: the
            # function's code may have changed since. It is compiled, and reused by its program.
            by_text = not any(p.function for p in plan.layers)
            hit = cache.lookup(self.engine, self.device, plan.digest) if by_text else None
            if hit and not cache.measure_again(
                hit.raw, budget=self.budget, repeats=spec.timing.repeats, anchored=spec.timing.anchor
            ):
                m = judge(hit.raw, budget=self.budget, gradient_tolerance=spec.gradient_tolerance)  # as the worker would
                # this study's own earlier trial; not where a study of the same name was deleted
                # and made again, and the cache's trial is this one
                if hit.study == spec.study and hit.trial != trial.number and _plan_of(study, hit.trial) == plan.digest:
                    reused_from = hit.trial
                    trial.set_user_attr(REUSED_ATTR, reused_from)
                else:
                    cached_from = f"{hit.study}#{hit.trial}"
                    trial.set_user_attr(CACHED_ATTR, cached_from)
            self.tell(Progress(
                event="trial", done=done, total=spec.trials, trial=TrialResult(
                    number=trial.number, status="running", plan=plan, labels=labels, reused_from=reused_from,
                    cached_from=cached_from,
                ),
            ))
            shared: list[cache.Cached] = []
            if m is None:
                m = _screened(spec, study, trial, self.space, plan, self.budget) or runner.measure(
                    plan, budget=self.budget, timing=spec.timing, gradient_tolerance=spec.gradient_tolerance,
                    known=lambda program: self._known(program, shared),
                )
            if self.stop.is_set():  # its worker was killed to stop the search: not a failure of the plan
                raise _Stopped
            if shared and m.same_program_as is not None:
                same_program = f"{shared[-1].study}#{shared[-1].trial}"
                trial.set_user_attr(SAME_PROGRAM_ATTR, same_program)
            if reused_from is None and cached_from is None:
                cache.store(self.engine, self.device, m, study=spec.study, trial=trial.number)
            with self.lock:  # the study's first anchored measurement sets its reference: one thread
                anchor = _anchor_seconds(study, m) if spec.timing.anchor else None
            m = m.model_copy(update={"anchor_seconds": anchor})
            _record(study, trial, m, self.budget, self.storage, self._id_of(trial))
        except BaseException:
            self._interrupt(trial)
            raise
        finally:
            self.heartbeats.remove(self._id_of(trial))
            if claimed:
                cache.release(self.engine, self.device, plan.digest, study=spec.study, trial=trial.number)
        self.tell(Progress(
            event="result", done=finished_trials(study), total=spec.trials, trial=TrialResult(
                number=trial.number, status=m.status, plan=plan, measurement=m, labels=labels,
                reused_from=reused_from, cached_from=cached_from, same_program_as=same_program, error=m.error,
            ),
        ))

    def _known(self, program: str, shared: list[cache.Cached]) -> RawMeasurement | None:
        """A measurement of the compiled ``program`` that can be judged for this study as it
        is (see :func:`cache.measure_again`), or None; one found is added to ``shared``."""
        hit = cache.lookup_program(self.engine, self.device, program)
        if hit is None or cache.measure_again(
            hit.raw, budget=self.budget, repeats=self.spec.timing.repeats, anchored=self.spec.timing.anchor
        ):
            return None
        shared.append(hit)
        return hit.raw

    def _claim(self, trial: optuna.Trial, plan: RematPlan) -> None:
        """Claim ``plan`` for ``trial``, waiting while a live trial (of any study on this
        database and device) measures it; a claim whose trial is gone is taken over."""
        while (holder := cache.claim(
            self.engine, self.device, plan.digest, study=self.spec.study, trial=trial.number
        )) is not None:
            if not self._running(*holder):
                cache.release(self.engine, self.device, plan.digest, study=holder[0], trial=holder[1])
                continue
            if self.stop.wait(POLL_SECONDS):
                raise _Stopped
            with self.lock:
                self._recover_if_due()

    def _running(self, study: str, number: int) -> bool:
        """Whether trial ``number`` of ``study`` is running (not finished, failed or gone)."""
        try:
            study_id = self.storage.get_study_id_from_name(study)
            trial_id = self.storage.get_trial_id_from_study_id_trial_number(study_id, number)
            return self.storage.get_trial(trial_id).state == TrialState.RUNNING
        except KeyError:
            return False

    def _recover_if_due(self) -> None:
        """Fail dead trials (and requeue their plans) once every heartbeat interval; the lock held."""
        if time.monotonic() - self.recovered >= self.spec.heartbeat.interval:
            recover(self.study, self.storage, n_params=self.space.n_params)
            self.recovered = time.monotonic()

    def _interrupt(self, trial: optuna.Trial) -> None:
        """Fail this process's ``trial`` as interrupted, and queue its plan again."""
        self.heartbeats.remove(self._id_of(trial))
        fail_and_requeue(self.study, self.storage, self._frozen(trial), n_params=self.space.n_params)

    def _id_of(self, trial: optuna.Trial) -> int:
        """The storage's id of this search's ``trial`` (optuna keeps its own private)."""
        return self.storage.get_trial_id_from_study_id_trial_number(self.study_id, trial.number)

    def _frozen(self, trial: optuna.Trial) -> optuna.trial.FrozenTrial:
        return self.storage.get_trial(self._id_of(trial))


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


def _anchor_seconds(study: optuna.Study, m: Measurement) -> float | None:
    """The study's reference time of the anchor plan: the anchor's median in the first
    anchored measurement the study recorded. Anchored step times are the plan's median
    ratio to the anchor in these seconds, so the study's times compare across hours."""
    if not m.anchor_times:
        return None
    reference = study.user_attrs.get(ANCHOR_ATTR)
    if reference is None:
        study.set_user_attr(ANCHOR_ATTR, statistics.median(m.anchor_times))
        reference = study.user_attrs[ANCHOR_ATTR]  # another search's, where it set one at the same moment
    return float(reference)


def _record(
    study: optuna.Study, trial: optuna.Trial, m: Measurement, budget: int,
    storage: optuna.storages.RDBStorage, trial_id: int,
) -> None:
    """Store a measurement, the budget constraint last, and finish the trial.

    A plan screened out is a prediction, not a measurement: its trial is PRUNED, with no
    objective values, so that nothing that reads the study's objectives (``best_trials``,
    optuna-dashboard) takes it for one. The prediction stays in its measurement attribute
    (``screened_bytes``); its constraint tells the samplers it is certainly over the budget
    (TPE ranks a pruned trial with a violated constraint among the infeasible)."""
    trial.set_user_attr(MEASUREMENT_ATTR, m.model_dump_json())
    if m.status == "failed":
        trial.set_user_attr(FAILURE_ATTR, m.error or "unknown failure")
        study.tell(trial, state=TrialState.FAIL)
        return
    if m.screened_bytes is not None:
        _constrain(m.screened_bytes / budget - 1.0, storage, trial_id)
        study.tell(trial, state=TrialState.PRUNED)
        return
    assert m.peak_bytes is not None
    seconds = m.step_seconds if m.status == "measured" else math.inf  # never run: no time
    _constrain(m.peak_bytes / budget - 1.0, storage, trial_id)
    study.tell(trial, [seconds, float(m.peak_bytes)])


def _constrain(value: float, storage: optuna.storages.RDBStorage, trial_id: int) -> None:
    """Record the budget constraint ``value`` as the trial's one constraint, in the list that
    ``constraints_func`` writes: optuna 5 reads it (as constraint ``"0"``), and optuna-dashboard
    reads only that list (not ``Trial.set_constraint``'s named keys)."""
    storage.set_trial_system_attr(trial_id, CONSTRAINTS_ATTR, [value])


def _open_study(
    spec: SearchSpec, budget: int, storage: optuna.storages.RDBStorage, device: DeviceInfo, space: Space
) -> optuna.Study:
    """Load the spec's study, refusing one made by another spec or on other devices; or create
    it with the presets queued."""
    identity = {
        **spec.model_dump(mode="json", include=set(IDENTITY_FIELDS)),
        "budget": budget,
        "device": device.model_dump(include=set(DEVICE_IDENTITY)),
    }
    study, _ = load_or_create(spec.study, storage)
    check_identity(spec, study)
    if study.user_attrs.get(INITIALIZED_ATTR):  # refused before anything is written
        _check_device_identity(spec.study, study, identity)
    settings = spec.model_dump(mode="json", include=set(SETTINGS_FIELDS))
    changed = changed_settings(study.user_attrs.get(SETTINGS_ATTR, {}), settings)
    for name in FIXED_SETTINGS:
        if name in changed:
            raise SpecError(
                f"spec.{name}: study {spec.study!r} was measured with {name} = "
                f"{json.dumps(changed[name][0])}, and its trials would not compare with ones measured with "
                f"{json.dumps(changed[name][1])}; set it back, or give this search a new study name"
            )
    prepare(spec, study, space)
    if not study.user_attrs.get(INITIALIZED_ATTR):  # new, submitted, or killed while being set up
        for key, value in identity.items():
            study.set_user_attr(key, value)
        study.set_user_attr("device_info", device.model_dump())
        study.set_user_attr(INITIALIZED_ATTR, True)
        _check_device_identity(spec.study, study, identity)  # another worker's, set at the same moment, wins
    for name, (old, new) in changed.items():
        logger.warning(
            "note: spec.%s changed from %s to %s since study %r was last searched: allowed, its trials "
            "stay comparable", name, json.dumps(old), json.dumps(new), spec.study,
        )
    study.set_user_attr(SETTINGS_ATTR, settings)
    # Not the same seed as last time: a resumed search must not replay its proposals.
    study.sampler = make_sampler(
        spec.sampler, space=space, budget=budget, offset=len(study.get_trials(deepcopy=False))
    )
    return study


def _check_device_identity(name: str, study: optuna.Study, identity: dict[str, Any]) -> None:
    """Refuse a study whose identity, the device that measures it included, is not ``identity``."""
    for key, value in identity.items():
        if as_written_now(key, study.user_attrs.get(key)) != value:
            raise identity_error(name, key, study.user_attrs.get(key))


def _plan_of(study: optuna.Study, number: int) -> str | None:
    """The plan digest of trial ``number`` of ``study`` (None if it has none, or no such trial)."""
    for t in study.get_trials(deepcopy=False):
        if t.number == number and PLAN_ATTR in t.user_attrs:
            return RematPlan.model_validate_json(t.user_attrs[PLAN_ATTR]).digest
    return None


def measure_params(study: optuna.Study, storage: str, params: dict[str, str]) -> StudyReport:
    """Measure the plan of ``params`` as one more trial of ``study``, as its last search
    measured (the same worker, cache and budget); return the study's report. Plans the study
    had already queued run first."""
    waiting = len(study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))
    spec = spec_of_study(study, storage, trials=finished_trials(study) + waiting + 1, confirm={"top": 0})
    enqueue(study, params)  # after the plans already queued, which run first
    return run(spec)


def plan_for_budget(study_name: str, budget: int, *, storage: str | None = None, measure: bool = False) -> Advice:
    """The planner's advice for ``budget`` on a stored study (:func:`planner.advise`); with
    ``measure``, first measure the advised plan as one more trial of the study unless it was
    measured already."""
    opened = open_storage(storage)
    study = load_study(study_name, opened)
    if measure and budget > study.user_attrs.get("budget", budget):
        raise SpecError(
            f"--budget: {format_bytes(budget)} is above the study's budget of "
            f"{format_bytes(study.user_attrs['budget'])}, where plans are not run; "
            "--measure times plans within it"
        )
    with translate_errors(opened.url):
        advice = advise(study, budget)
    if measure and advice.measured is None:
        report = measure_params(study, opened.url, advice.params)
        advice = advice.model_copy(update={"measured": measured_trial(report, advice.plan)})
    return advice
