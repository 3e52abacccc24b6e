"""End to end through real worker processes and real SQLite files."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import optuna
import pytest
from optuna.trial import TrialState

import remat_search
from remat_search import RematPlan, SpecError
from remat_search.measure.executables import Executables, measure
from remat_search.spec.loading import parse_spec
from remat_search.spec.models import TimingConfig
from remat_search.store.attributes import SPEC_ATTR
from remat_search.search.progress import Progress
from remat_search.search.study import spec_of_study
from remat_search.units import format_bytes

from tests.conftest import FAST_TIMING, TINY_TRANSFORMER, spec_dict, write_spec
from tests.factories import recording


def _compiled_peak(workload: remat_search.Workload, policy: str) -> int:
    """The compiled peak of a uniform plan, without running it (budget 1)."""
    m = measure(Executables(workload), RematPlan.uniform(policy, workload.layers), budget=1,
                timing=TimingConfig(), gradient_tolerance=1e-4)
    assert m.status == "over_budget"
    return m.peak_bytes


def test_over_budget_plan_is_recorded_and_never_executed(tmp_path: Path, storage_url: str) -> None:
    log = tmp_path / "executions.log"
    workload = recording(str(log))
    none_peak, full_peak = _compiled_peak(workload, "none"), _compiled_peak(workload, "full")
    assert full_peak < none_peak and not log.exists()
    budget = (none_peak + full_peak) // 2
    spec = parse_spec(spec_dict(
        storage_url, workload={"factory": "tests.factories:recording", "args": {"log": str(log)}},
        space={"layout": "uniform", "choices": ["none", "full", "dots"]}, budget=budget, trials=3,
        confirm={"top": 2, "rounds": 2, "presets": True},
    ))
    report = remat_search.run(spec)

    by_label = {t.labels[0]: t for t in report.trials}
    assert by_label["none"].status == "over_budget" and by_label["none"].peak_bytes == none_peak
    assert by_label["full"].status == "measured"
    assert by_label["full"].measurement.grad_reference == "full"  # checked against a reference that fits
    assert sum(bool(t.confirmed) for t in report.trials) == 2  # full and dots, re-timed
    executed = set(log.read_text().split())  # every evaluation of the loss: steps, references, re-timing
    assert by_label["full"].plan.digest in executed
    assert by_label["none"].plan.digest not in executed  # compiled, never run: no step, no gradient
    peaks = {t.plan.digest: t.peak_bytes for t in report.trials}  # the anchor, full remat, among them
    assert executed <= set(peaks) and all(peaks[d] <= budget for d in executed)
    study = optuna.load_study(study_name="tiny", storage=storage_url)
    infeasible = next(t for t in study.trials if t.number == by_label["none"].number)
    assert infeasible.state == TrialState.COMPLETE and list(infeasible.constraints.values()) == [  # one: the budget
        infeasible.values[1] / budget - 1
    ]
    assert by_label["none"].number not in [t.number for t in report.front]


@pytest.mark.parametrize(
    ("factory", "timeout", "reason"),
    [("tests.factories:raising", "120s", "this model is broken"),
     ("tests.factories:hanging", "3s", "timed out after 3 s")],
)
def test_a_failing_candidate_fails_its_trial_and_the_study_goes_on(
    storage_url: str, factory: str, timeout: str, reason: str
) -> None:
    spec = parse_spec(spec_dict(
        storage_url, workload={"factory": factory}, trials=2,
        space={"layout": "uniform", "choices": ["full", "dots"]},
        timing={**FAST_TIMING, "timeout": timeout},
    ))
    report = remat_search.run(spec)
    assert [t.status for t in report.trials] == ["failed", "failed"]
    assert all(reason in t.error for t in report.trials)
    study = optuna.load_study(study_name="tiny", storage=storage_url)
    assert [t.state for t in study.trials] == [TrialState.FAIL, TrialState.FAIL]


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, remat_search.StudyReport]:
    """One finished per-layer study on the tiny transformer, shared by the query tests."""
    folder = tmp_path_factory.mktemp("finished")
    storage = f"sqlite:///{folder / 'studies.db'}"
    spec_path = write_spec(folder / "spec.yaml", spec_dict(storage, trials=8))
    report = remat_search.run(remat_search.load_spec(spec_path))
    return storage, spec_path, report


def test_presets_come_first_and_every_trial_is_accounted_for(finished) -> None:  # type: ignore[no-untyped-def]
    storage, _, report = finished
    with sqlite3.connect(storage.removeprefix("sqlite:///")) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert len(report.trials) == 8
    assert [t.summary() for t in report.trials[:4]] == ["none×2", "full×2", "dots×2", "save_attn×2"]
    assert {t.status for t in report.trials} <= {"measured", "over_budget"}


def test_pareto_front_is_not_dominated(finished) -> None:  # type: ignore[no-untyped-def]
    storage, _, report = finished
    front = remat_search.pareto_front("tiny", storage)
    assert front and [t.number for t in front] == [t.number for t in report.front]
    timed = report.timed()
    assert any(t.time_source == "confirmed" for t in timed)  # so the front is of each plan's one time

    def dominates(a: remat_search.TrialResult, b: remat_search.TrialResult) -> bool:
        return a.seconds <= b.seconds and a.peak_bytes <= b.peak_bytes and (a.seconds, a.peak_bytes) != (b.seconds, b.peak_bytes)

    for f in front:
        assert not any(dominates(t, f) for t in timed)
    numbers = {f.number for f in front}
    for t in timed:  # and every plan off the front is beaten by one on it (or ties it)
        assert t.number in numbers or any(dominates(f, t) or (f.seconds, f.peak_bytes) == (t.seconds, t.peak_bytes) for f in front)


def test_best_is_the_fastest_timed_plan_that_fits(tmp_path: Path, storage_url: str, cli) -> None:  # type: ignore[no-untyped-def]
    """Which plan is fastest is set up front: full remat is slowed by 60 ms a step, so no
    remat is the answer where it fits, and full remat where only it fits."""
    delays = tmp_path / "delays.json"
    delays.write_text(json.dumps({"full×3": 60}))
    report = remat_search.run(parse_spec(spec_dict(
        storage_url, workload={"factory": "tests.factories:delayed", "args": {"delays": str(delays)}},
        space={"layout": "uniform", "choices": ["none", "full"]}, trials=2,
    )))
    peak = {t.summary(): t.peak_bytes for t in report.trials}
    assert peak["full×3"] < peak["none×3"]
    assert remat_search.best_plan("tiny", "1GiB", storage_url).summary() == "none×3"
    assert remat_search.best_plan("tiny", peak["none×3"] - 1, storage_url).summary() == "full×3"

    result = cli("best", "--study", "tiny", "--budget", "1GiB", "--storage", storage_url, "--json")
    assert result.exit_code == 0, result.stderr
    plan = RematPlan.from_json(result.stdout)
    assert plan == RematPlan.uniform("none", 3)

    def layer(x: jax.Array) -> jax.Array:
        return jnp.sin(x) * 2

    for i, policy in enumerate(plan.layers):
        eqns = jax.make_jaxpr(plan.wrap(layer, i))(jnp.ones(3)).eqns
        assert any(e.primitive.name.startswith("remat") for e in eqns) == (policy.kind != "none")


def test_best_when_nothing_fits_exits_1_and_names_the_smallest_peak(finished, cli) -> None:  # type: ignore[no-untyped-def]
    storage, _, report = finished
    smallest = min(t.peak_bytes for t in report.trials)
    result = cli("best", "--study", "tiny", "--budget", "1KiB", "--storage", storage)
    assert result.exit_code == 1
    assert "no measured plan" in result.stderr and format_bytes(smallest) in result.stderr


def test_reports_from_the_cli(finished, cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    storage, _, report = finished
    result = cli("pareto", "--study", "tiny", "--storage", storage, "--json", "--plot", str(tmp_path / "front.png"))
    assert result.exit_code == 0, result.stderr
    assert [t["number"] for t in json.loads(result.stdout)] == [t.number for t in report.front]
    assert (tmp_path / "front.png").read_bytes()[:4] == b"\x89PNG"
    assert "tiny" in cli("studies", "--storage", storage).stdout
    shown = cli("show", "--study", "tiny", "--trial", "1", "--storage", storage).stdout
    assert "layers  0–1: full" in shown and "layer " not in shown and "peak" in shown  # a run of one policy: one line
    mixed = [t for t in report.trials if t.plan and len({str(p) for p in t.plan.layers}) > 1]
    assert mixed, "the planner's plans differ by layer"
    shown = cli("show", "--study", "tiny", "--trial", str(mixed[0].number), "--storage", storage).stdout
    assert "layer  0: " in shown and "layer  1: " in shown and "layers " not in shown


def test_rerunning_a_finished_study_measures_nothing_more(finished, cli) -> None:  # type: ignore[no-untyped-def]
    _, spec_path, report = finished
    again = remat_search.run(remat_search.load_spec(spec_path))
    assert [t.number for t in again.trials] == [t.number for t in report.trials]
    result = cli("run", str(spec_path))
    assert result.exit_code == 0, result.stderr
    assert "--budget 1GiB --json" in " ".join(result.stdout.split())  # the hint, as the user would type it


def test_resuming_with_another_budget_is_refused(finished, cli) -> None:  # type: ignore[no-untyped-def]
    storage, spec_path, _ = finished
    db = Path(storage.removeprefix("sqlite:///"))
    before = db.read_bytes()
    changed = write_spec(spec_path.with_name("changed.yaml"), spec_dict(storage, trials=8, budget="2GiB"))
    result = cli("run", str(changed))
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and "spec.budget: study 'tiny' already exists" in result.stderr
    assert db.read_bytes() == before


def test_a_study_stored_before_a_field_existed_resumes_with_that_field_at_its_default(
    finished, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """A study stored by a version whose workload had no ``scan`` or ``dtype`` yet (the spec and
    the identity attributes without them) is the same study for this version, whose defaults
    they are: rerunning its spec is no identity error. Another value of them still is."""
    storage, _, report = finished
    copy = tmp_path / "studies.db"
    with sqlite3.connect(storage.removeprefix("sqlite:///")) as source, sqlite3.connect(copy) as target:
        source.backup(target)
    older = f"sqlite:///{copy}"
    study = optuna.load_study(study_name="tiny", storage=older)
    workload = {k: v for k, v in study.user_attrs["workload"].items() if k not in ("scan", "dtype")}
    study.set_user_attr("workload", workload)
    study.set_user_attr(SPEC_ATTR, {**study.user_attrs[SPEC_ATTR], "workload": workload})
    again = remat_search.run(parse_spec(spec_dict(older, trials=8)))
    assert [t.number for t in again.trials] == [t.number for t in report.trials]
    with pytest.raises(SpecError, match="spec.workload: study 'tiny' already exists with another workload"):
        remat_search.run(parse_spec(spec_dict(older, trials=8, workload={**TINY_TRANSFORMER, "scan": True})))


def test_a_study_stored_before_attention_auto_resumes_with_dense_attention(
    finished, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """A study stored without ``attention`` was searched with dense attention, the default then:
    its spec (which leaves attention unset, now ``auto``) resumes it as dense, as do ``confirm``
    and ``plan --measure`` (:func:`spec_of_study`); an explicit ``auto`` is another workload.
    A study stored with ``auto`` resumes as ``auto``."""
    storage, _, report = finished
    assert spec_of_study(optuna.load_study(study_name="tiny", storage=storage), storage).workload.attention == "auto"
    copy = tmp_path / "studies.db"
    with sqlite3.connect(storage.removeprefix("sqlite:///")) as source, sqlite3.connect(copy) as target:
        source.backup(target)
    older = f"sqlite:///{copy}"
    study = optuna.load_study(study_name="tiny", storage=older)
    workload = {k: v for k, v in study.user_attrs["workload"].items() if k != "attention"}
    study.set_user_attr("workload", workload)
    study.set_user_attr(SPEC_ATTR, {**study.user_attrs[SPEC_ATTR], "workload": workload})
    assert spec_of_study(study, older).workload.attention == "dense"
    again = remat_search.run(parse_spec(spec_dict(older, trials=8)))
    assert [t.number for t in again.trials] == [t.number for t in report.trials]
    assert optuna.load_study(study_name="tiny", storage=older).user_attrs[SPEC_ATTR]["workload"]["attention"] == "dense"
    with pytest.raises(SpecError, match="spec.workload: study 'tiny' already exists with another workload"):
        remat_search.run(parse_spec(spec_dict(older, trials=8, workload={**TINY_TRANSFORMER, "attention": "auto"})))


def test_a_local_mesh_runs_the_step_on_sharded_inputs(storage_url: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Two CPU devices (XLA's host device count, which the worker inherits): over a data mesh
    each device holds half the batch, so its compiled arguments shrink (its temporaries did on
    jaxlib 0.10; on 0.12 XLA:CPU's sharded program holds 3% more), and the sharded step runs and
    passes the gradient check."""
    common = {"workload": {"kind": "mlp", "layers": 2, "width": 32, "hidden": 256, "batch": 64},
              "space": {"layout": "uniform", "choices": ["none", "full"]}, "trials": 2, "confirm": {"top": 0}}
    single = remat_search.run(parse_spec(spec_dict(storage_url, study="single", **common)))
    monkeypatch.setenv("XLA_FLAGS", f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2")
    sharded = remat_search.run(parse_spec(spec_dict(storage_url, study="sharded", mesh={"data": 2}, **common)))
    assert sharded.device["mesh"] == {"data": 2} and sharded.device["device_count"] == 2
    for one, two in zip(single.trials, sharded.trials, strict=True):
        assert two.status == "measured" and two.measurement.time_source == "measured", two.error
        assert two.measurement.grad_rel_error is not None
        assert two.measurement.memory.argument < one.measurement.memory.argument  # half the batch a device


def test_an_interrupted_search_fails_its_trial_and_requeues_the_plan(storage_url: str) -> None:
    spec = parse_spec(spec_dict(
        storage_url, workload={"factory": "tests.factories:hanging"}, trials=2,
        space={"layout": "uniform", "choices": ["full", "dots"]},
        timing={**FAST_TIMING, "timeout": "3s"},
    ))

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    def arm_before_the_first_trial(progress: Progress) -> None:
        if progress.event == "start":
            signal.alarm(1)  # Ctrl-C while the first candidate is being measured

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            remat_search.run(spec, on_progress=arm_before_the_first_trial)
        # every thread has put its trial back before run() returns (on 3.11 an interrupted
        # Thread.join marks a live thread stopped: waiting on it so let threads outlive run())
        assert [t.name for t in threading.enumerate() if t.name.startswith("remat-search-worker")] == []
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)

    report = remat_search.run(spec)  # the same process runs it again
    assert [t.status for t in report.trials] == ["interrupted", "failed", "failed"]
    assert [t.summary() for t in report.trials] == ["full×3", "dots×3", "full×3"]


@pytest.mark.parametrize(
    ("change", "field"),
    [({"timing": {**FAST_TIMING, "anchor": False}}, "spec.timing.anchor"),
     ({"gradient_tolerance": 0.5}, "spec.gradient_tolerance")],
)
def test_resuming_with_a_change_that_makes_trials_incomparable_is_refused(finished, cli, change, field) -> None:  # type: ignore[no-untyped-def]
    storage, spec_path, _ = finished
    db = Path(storage.removeprefix("sqlite:///"))
    before = db.read_bytes()
    result = cli("run", str(write_spec(spec_path.with_name("changed.yaml"), spec_dict(storage, trials=8, **change))))
    assert result.exit_code == 2, result.stdout + result.stderr
    assert result.stderr.count("\n") == 1 and f"{field}: study 'tiny' was measured with" in result.stderr
    assert db.read_bytes() == before


def test_resuming_with_other_repeats_or_sampler_is_allowed_and_said(finished, cli) -> None:  # type: ignore[no-untyped-def]
    storage, spec_path, report = finished
    changed = spec_dict(storage, trials=8, timing={**FAST_TIMING, "repeats": 3}, sampler={"kind": "random", "seed": 0})
    result = cli("run", str(write_spec(spec_path.with_name("changed.yaml"), changed)))
    assert result.exit_code == 0, result.stderr
    notes = [line for line in result.stderr.splitlines() if line.startswith("note: spec.")]
    assert sorted(n.split()[1] for n in notes) == ["spec.sampler.kind", "spec.timing.repeats"]
    assert all("allowed" in n for n in notes)
    assert [t.number for t in remat_search.load_report("tiny", storage).trials] == [t.number for t in report.trials]
    back = cli("run", str(spec_path))  # and back again: said again, still allowed
    assert back.exit_code == 0 and "note: spec.timing.repeats changed from 3 to 2" in back.stderr


def test_a_failed_confirmation_keeps_the_search_and_fails_the_run(tmp_path: Path, storage_url: str, cli) -> None:  # type: ignore[no-untyped-def]
    """The machine goes away (the worker is killed) as the confirmation starts: the re-timing
    fails, the run fails at run time (exit 3, not 0 and not "bad input"), and the search's
    trials stay as they were. Independent of the host's speed: no timeout decides it (the
    search's is one no compile reaches; the worker dies at the confirmation's first step)."""
    delays = tmp_path / "delays.json"
    delays.write_text("{}")
    spec = parse_spec(spec_dict(
        storage_url, workload={"factory": "tests.factories:delayed", "args": {"delays": str(delays)}},
        space={"layout": "uniform", "choices": ["none", "full"]}, trials=2,
    ))

    def kill_the_worker(p: Progress) -> None:
        if p.event == "confirm":
            delays.write_text(json.dumps({"die": True}))

    died = r"re-timing failed \(worker killed by signal SIGKILL"
    with pytest.raises(remat_search.RunError, match=f"{died}.*the search's 2 trials are kept"):
        remat_search.run(spec, on_progress=kill_the_worker)
    report = remat_search.load_report("tiny", storage_url)
    assert [t.status for t in report.trials] == ["measured", "measured"]
    assert not any(t.confirmed for t in report.trials)

    result = cli("confirm", "--study", "tiny", "--storage", storage_url, "--rounds", "2")
    assert result.exit_code == 3, result.stdout + result.stderr
    assert re.match(f"error: confirm: {died}", result.stderr) and result.stderr.count("\n") == 1
