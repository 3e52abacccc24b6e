"""The search loop: spec → plans → measurements → an optuna study that survives crashes.

:func:`run` checks everything a spec names before it writes anything, then asks optuna
for plans until the study holds ``spec.trials`` finished trials. Each trial carries two
objectives (median step seconds, peak bytes) and the budget as a constraint
(``peak / budget − 1``, feasible when ≤ 0). Running the same spec again resumes: trials
left running by a killed search are failed and their plans queued again.
"""

from __future__ import annotations

import json
import logging
import math
import socket
import statistics
from collections.abc import Callable

import optuna
import psutil
import sqlalchemy
from optuna.trial import TrialState

from remat_search import cache
from remat_search.confirm import confirm
from remat_search.errors import NoFeasiblePlan, RematSearchError, RunError, SpecError
from remat_search.measurement import Measurement, judge
from remat_search.plan import RematPlan
from remat_search.planner import (
    Advice,
    advise,
    check_sampler,
    make_sampler,
    measured_trial,
    record_prediction,
    study_cost_model,
)
from remat_search.policy import POLICIES
from remat_search.results import StudyReport, TrialResult, study_report
from remat_search.runner import DeviceInfo, Runner
from remat_search.space import Space
from remat_search.spec import SearchSpec
from remat_search.store import (
    ANCHOR_ATTR,
    CACHED_ATTR,
    FAILURE_ATTR,
    HOST_ATTR,
    INTERRUPTED,
    LABELS_ATTR,
    LAYERS_ATTR,
    MEASUREMENT_ATTR,
    PID_ATTR,
    PLAN_ATTR,
    PREDICTION_ATTR,
    QUEUED_ATTR,
    REUSED_ATTR,
    STARTED_ATTR,
    check_storage,
    load_study,
    open_storage,
    orphaned,
    translate_errors,
)
from remat_search.study import (
    DEVICE_IDENTITY,
    FIXED_SETTINGS,
    IDENTITY_FIELDS,
    SETTINGS_ATTR,
    SETTINGS_FIELDS,
    Progress,
    ProgressCallback,
    changed_settings,
    finished_trials,
    resolve_budget,
    runner_for,
    spec_of_study,
)
from remat_search.units import format_bytes, size_argument
from remat_search.workload import build_workload

logger = logging.getLogger("remat_search")
BUDGET_CONSTRAINT = "budget"
INITIALIZED_ATTR = "initialized"

def run(spec: SearchSpec, *, on_progress: ProgressCallback | None = None) -> StudyReport:
    """Search ``spec`` until its study holds ``spec.trials`` finished trials; return the report.

    ``on_progress`` hears a :class:`~remat_search.study.Progress` when the study is open
    (``start``), before and after every trial (``trial``, ``result``) and around the
    confirmation (``confirm``, ``confirmed``).
    """
    tell = on_progress or (lambda _: None)
    check_storage(spec.storage, create=True)  # fail fast, before the worker starts
    workload = build_workload(spec.workload)
    space = Space.of(spec.space, workload.layers)
    space.check_names(workload.tensor_names)
    check_sampler(spec.sampler)
    with runner_for(spec) as runner:
        device = runner.describe()
        offload = [c.label for c in spec.space.choices if POLICIES[c.policy.kind].host_memory]
        if offload and device.platform == "cpu":
            raise SpecError(
                f"spec.space.choices: {offload} offload to host memory, which needs a GPU or TPU; "
                "this machine compiles for cpu"
            )
        budget = resolve_budget(spec.budget, device)
        storage = open_storage(spec.storage, create=True)
        with translate_errors(spec.storage):  # the storage calls that open the study; later ones fail at run time
            cache.create_table(storage.engine)
            study = _open_study(spec, budget, storage, device, space)
            _requeue_interrupted(study, storage, space.n_params)
        tell(Progress(event="start", done=finished_trials(study), total=spec.trials, device=device, budget=budget))
        # Counted afresh each time: other processes may be searching the same study.
        while (done := finished_trials(study)) < spec.trials:
            result = _run_trial(
                spec, budget, study, runner, space, storage.engine, device,
                begins=lambda t: tell(Progress(event="trial", done=done, total=spec.trials, trial=t)),
            )
            tell(Progress(event="result", done=done + 1, total=spec.trials, trial=result))
        if spec.confirm.top and device.executes:
            try:
                return confirm(
                    study, runner, budget=budget, top=spec.confirm.top, rounds=spec.confirm.rounds,
                    warmup=spec.timing.warmup, presets=spec.confirm.presets, on_progress=on_progress,
                )
            except NoFeasiblePlan:
                pass  # nothing ran within the budget: nothing to confirm
            except RematSearchError as e:
                raise RunError(
                    f"{e}; the search's {finished_trials(study)} trials are kept, and "
                    f"`remat-search confirm --study {spec.study}` tries the confirmation again"
                ) from None
        return study_report(study)


def _run_trial(
    spec: SearchSpec,
    budget: int,
    study: optuna.Study,
    runner: Runner,
    space: Space,
    engine: sqlalchemy.Engine,
    device: DeviceInfo,
    *,
    begins: Callable[[TrialResult], None],
) -> TrialResult:
    """Ask for one plan, measure it (or reuse its cached measurement), record it; ``begins``
    hears the trial (status ``running``) once its plan is known, before it is measured.

    If anything interrupts it here (Ctrl-C, a worker that cannot restart), the trial is
    failed as interrupted and its plan queued again before the error goes on.
    """
    trial = study.ask()
    reused_from = cached_from = None
    m: Measurement | None = None
    try:
        me = psutil.Process()
        trial.set_user_attr(HOST_ATTR, socket.gethostname())
        trial.set_user_attr(PID_ATTR, me.pid)
        trial.set_user_attr(STARTED_ATTR, me.create_time())
        plan = space.suggest(trial)
        record_prediction(study, trial)
        labels = space.layer_labels(trial.params)
        trial.set_user_attr(PLAN_ATTR, plan.to_json())
        trial.set_user_attr(LABELS_ATTR, list(labels))
        hit = cache.lookup(engine, device, plan.digest)
        if hit and not cache.measure_again(
            hit.raw, budget=budget, repeats=spec.timing.repeats, anchored=spec.timing.anchor
        ):
            m = judge(hit.raw, budget=budget, gradient_tolerance=spec.gradient_tolerance)  # as the worker would
            if hit.study == spec.study and _plan_of(study, hit.trial) == plan.digest:
                reused_from = hit.trial
                trial.set_user_attr(REUSED_ATTR, reused_from)
            else:
                cached_from = f"{hit.study}#{hit.trial}"
                trial.set_user_attr(CACHED_ATTR, cached_from)
        begins(TrialResult(
            number=trial.number, status="running", plan=plan, labels=labels, reused_from=reused_from,
            cached_from=cached_from,
        ))
        if m is None:
            m = _screened(spec, study, trial, space, plan, budget) or runner.measure(
                plan, budget=budget, timing=spec.timing, gradient_tolerance=spec.gradient_tolerance,
            )
    except BaseException:
        _interrupt(study, trial, space.n_params)
        raise
    if reused_from is None and cached_from is None:
        cache.store(engine, device, m, study=spec.study, trial=trial.number)
    m = m.model_copy(update={"anchor_seconds": _anchor_seconds(study, m) if spec.timing.anchor else None})
    _record(study, trial, m, budget)
    return TrialResult(
        number=trial.number, status=m.status, plan=plan, measurement=m, labels=labels,
        reused_from=reused_from, cached_from=cached_from, error=m.error,
    )


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
        reference = statistics.median(m.anchor_times)
        study.set_user_attr(ANCHOR_ATTR, reference)
    return float(reference)


def _record(study: optuna.Study, trial: optuna.Trial, m: Measurement, budget: int) -> None:
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
        trial.set_constraint(BUDGET_CONSTRAINT, m.screened_bytes / budget - 1.0)
        study.tell(trial, state=TrialState.PRUNED)
        return
    assert m.peak_bytes is not None
    seconds = m.step_seconds if m.status == "measured" else math.inf  # never run: no time
    trial.set_constraint(BUDGET_CONSTRAINT, m.peak_bytes / budget - 1.0)
    study.tell(trial, [seconds, float(m.peak_bytes)])


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
    existing = {s.study_name for s in optuna.get_all_study_summaries(storage, include_best_trial=False)}
    if spec.study not in existing:
        try:
            optuna.create_study(study_name=spec.study, storage=storage, directions=["minimize", "minimize"])
        except optuna.exceptions.DuplicatedStudyError:
            pass  # another process created it a moment ago
    study = optuna.load_study(study_name=spec.study, storage=storage)
    if not study.user_attrs.get(INITIALIZED_ATTR):  # new, or killed while being set up
        for key, value in identity.items():
            study.set_user_attr(key, value)
        study.set_user_attr("device_info", device.model_dump())
        study.set_user_attr(LAYERS_ATTR, space.layers)
        queued = [t.user_attrs.get(QUEUED_ATTR) for t in study.get_trials(deepcopy=False)]
        for params in space.presets():
            if params not in queued:
                _enqueue(study, params)
        study.set_user_attr(INITIALIZED_ATTR, True)
    for key, value in identity.items():
        if study.user_attrs.get(key) != value:
            stored = study.user_attrs.get(key)
            shown = size_argument(stored) if key == "budget" and isinstance(stored, int) else json.dumps(stored)[:160]
            raise SpecError(
                f"spec.{'target' if key == 'device' else key}: study {spec.study!r} already exists "
                f"with another {key} ({shown}); give this search a new study name"
            )
    settings = spec.model_dump(mode="json", include=set(SETTINGS_FIELDS))
    changed = changed_settings(study.user_attrs.get(SETTINGS_ATTR, {}), settings)
    for name in FIXED_SETTINGS:
        if name in changed:
            raise SpecError(
                f"spec.{name}: study {spec.study!r} was measured with {name} = "
                f"{json.dumps(changed[name][0])}, and its trials would not compare with ones measured with "
                f"{json.dumps(changed[name][1])}; set it back, or give this search a new study name"
            )
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


def _requeue_interrupted(study: optuna.Study, storage: optuna.storages.RDBStorage, n_params: int) -> None:
    """Fail trials whose search process is gone, and queue their plans again."""
    study_id = storage.get_study_id_from_name(study.study_name)
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if orphaned(trial):
            # Another process's trial: no optuna.Trial here to write through, so the storage's.
            trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, trial.number)
            storage.set_trial_user_attr(trial_id, FAILURE_ATTR, INTERRUPTED)
            _fail_and_requeue(study, trial, n_params)


def _interrupt(study: optuna.Study, trial: optuna.Trial, n_params: int) -> None:
    """Fail this process's ``trial`` as interrupted, and queue its plan again."""
    trial.set_user_attr(FAILURE_ATTR, INTERRUPTED)
    _fail_and_requeue(study, trial, n_params)


def _fail_and_requeue(
    study: optuna.Study, trial: optuna.Trial | optuna.trial.FrozenTrial, n_params: int
) -> None:
    """Fail ``trial``; queue its plan again if it had chosen all ``n_params``."""
    study.tell(trial.number, state=TrialState.FAIL)
    params = trial.user_attrs.get(QUEUED_ATTR) or trial.params  # a queued preset, or sampled
    if len(params) == n_params:
        _enqueue(study, params)


def _enqueue(study: optuna.Study, params: dict) -> None:
    """Queue a plan's parameters, recorded as queued (:data:`store.QUEUED_ATTR`)."""
    study.enqueue_trial(params, user_attrs={QUEUED_ATTR: params})


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
    _enqueue(study, params)  # after the plans already queued, which run first
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
