"""The measurement cache, confirmation and the planner's `plan` command, through real workers."""

from __future__ import annotations

import datetime
import json
import os
import sqlite3
from collections import Counter
from pathlib import Path

import optuna
import pytest
import sqlalchemy as sa

import remat_search
from remat_search import RematPlan
from remat_search.store import cache
from remat_search.measure.executables import KEPT_EXECUTABLES, Executables, anchor_plan, measure
from remat_search.measure.measurement import MEASUREMENT_SCHEMA, Measurement, MemoryBreakdown, RawMeasurement, judge
from remat_search.measure.device import DeviceInfo
from remat_search.measure.runner import Runner
from remat_search.spec.loading import parse_spec
from remat_search.spec.models import TimingConfig
from remat_search.units import format_seconds

from tests.conftest import spec_dict
from tests.factories import counting, miscomputing


def _events(log: Path) -> list[tuple[str, str, int]]:
    """(``lower`` or ``trace``, plan digest, process id) as ``tests.factories:counting`` logs them."""
    lines = log.read_text().splitlines() if log.exists() else []
    return [(what, digest, int(pid)) for what, digest, pid in (line.split() for line in lines)]


def _compiled(log: Path) -> list[str]:
    """The digests lowered for compiling, in order."""
    return [digest for what, digest, _ in _events(log) if what == "lower"]


def _assert_compiled_once_per_worker(log: Path, none: str) -> None:
    """In each worker process, every plan was lowered at most once, and the loss was traced
    by nothing else: once a lowering, plus the no-remat step's jaxpr (the program fingerprint,
    never compiled) at most once a worker (jax 0.10 traces it for both; with jax 0.12 a worker
    was seen tracing the no-remat loss once for the jaxpr and its lowering together)."""
    events = _events(log)
    lowered = Counter((digest, pid) for what, digest, pid in events if what == "lower")
    traced = Counter((digest, pid) for what, digest, pid in events if what == "trace")
    workers = {pid for _, _, pid in events}
    assert os.getpid() not in workers  # the search process compiles nothing
    assert max(lowered.values()) == 1, lowered
    assert lowered <= traced <= lowered + Counter((none, pid) for pid in workers), (traced, lowered)


def test_a_plan_is_compiled_once_across_trials_reruns_and_studies(tmp_path: Path, storage_url: str) -> None:
    log = tmp_path / "traces.log"
    workload = {"factory": "tests.factories:counting", "args": {"log": str(log)}}
    space = {"layout": "uniform", "choices": ["none", "full", "dots"]}  # full×3 is also the anchor
    confirm = {"top": 2, "rounds": 2, "presets": True}
    none, anchor = RematPlan.uniform("none", 3).digest, anchor_plan(3).digest
    first = remat_search.run(parse_spec(spec_dict(
        storage_url, study="first", workload=workload, space=space, trials=3, confirm=confirm,
    )))
    assert [t.status for t in first.trials] == ["measured"] * 3
    assert all(t.confirmed for t in first.trials)  # every plan re-timed, by the worker that measured it
    compiled = _compiled(log)
    uniform = {t.plan.digest for t in first.trials}
    assert sorted(compiled) == sorted(uniform)  # each once: the anchor and reference is full×3's own compile
    _assert_compiled_once_per_worker(log, none)

    again = remat_search.run(parse_spec(spec_dict(
        storage_url, study="first", workload=workload, space=space, trials=3, confirm=confirm,
    )))
    assert len(again.trials) == 3 and _compiled(log) == compiled  # a finished, confirmed search: nothing

    by_label = {t.labels[0]: t for t in first.trials}
    # full and dots fit the new study's budget, no remat does not (which of the two is lower is
    # XLA's: full on jaxlib 0.10, dots on 0.12)
    budget = max(by_label["full"].peak_bytes, by_label["dots"].peak_bytes) + 1
    second = remat_search.run(parse_spec(spec_dict(
        storage_url, study="second", workload=workload, space=space, trials=3, budget=budget, confirm=confirm,
    )))
    confirmed = {t.plan.digest for t in second.trials if t.confirmed}
    assert len(confirmed) >= 2 and none not in confirmed
    assert sorted(_compiled(log)[len(compiled):]) == sorted(confirmed)  # only to re-time them in this worker
    compiled = _compiled(log)
    assert {t.labels[0]: t.status for t in second.trials} == {
        label: "measured" if t.peak_bytes <= budget else "over_budget" for label, t in by_label.items()
    }
    assert by_label["none"].peak_bytes > budget  # so the cache re-judged a measured plan as over budget
    assert {t.labels[0]: t.cached_from for t in second.trials} == {
        label: f"first#{t.number}" for label, t in by_label.items()
    }
    full = next(t for t in second.trials if t.labels[0] == "full")
    timed_alike = {"anchor_seconds"}  # each study states times in its own anchor's seconds
    assert full.measurement.model_dump(exclude=timed_alike) == by_label["full"].measurement.model_dump(exclude=timed_alike)

    wider = remat_search.run(parse_spec(spec_dict(
        storage_url, study="third", workload=workload, space={"layout": "per_layer", "choices": ["none", "full"]},
        trials=4, confirm=confirm, sampler={"kind": "random", "seed": 4},  # two mixes
    )))
    new = _compiled(log)[len(compiled):]
    measured_here = {t.plan.digest for t in wider.trials if t.cached_from is None}
    assert measured_here and measured_here <= set(new)
    confirmed = {t.plan.digest for t in wider.trials if t.confirmed}
    assert {none, anchor} <= confirmed  # the presets, measured by the first study, re-timed here…
    assert sorted(new) == sorted(measured_here | confirmed | {anchor})  # …so compiled once in this worker
    _assert_compiled_once_per_worker(log, none)

    edited = {"factory": "tests.factories:counting", "args": {"log": str(log), "scale": 2.0}}
    before = len(_compiled(log))
    remat_search.run(parse_spec(spec_dict(
        storage_url, study="edited", workload=edited, space=space, trials=3, confirm=confirm,
    )))
    assert sorted(_compiled(log)[before:]) == sorted(uniform)  # other code: anew, each once
    _assert_compiled_once_per_worker(log, none)


def test_the_worker_fills_the_jax_compilation_cache(tmp_path: Path, storage_url: str) -> None:
    cache = tmp_path / "jax-cache"
    remat_search.run(parse_spec(spec_dict(
        storage_url, workload={"kind": "mlp", "layers": 2, "width": 16, "hidden": 32, "batch": 8},
        space={"layout": "uniform", "choices": ["full"]}, trials=1, compilation_cache=str(cache),
    )))
    assert any(cache.iterdir())


FULL_MS = 100
"""ms full remat's step is made slower than no remat's in :func:`delayed_study`'s tests."""


@pytest.fixture
def delayed_study(tmp_path: Path, storage_url: str) -> tuple[str, Path]:
    """A finished study whose search timed `none` during a busy spell (+200 ms a step) and
    `full` during a milder one (+100 ms): the search ranks full first. Full remat's own +100 ms
    (:data:`FULL_MS`), which the tests keep when they re-time, is beyond what a loaded host
    adds to any one step (the suite once saw a round within noise at +20 ms, both cores busy)."""
    delays = tmp_path / "delays.json"
    delays.write_text(json.dumps({"none×3": 2 * FULL_MS, "full×3": FULL_MS}))
    remat_search.run(parse_spec(spec_dict(
        storage_url, workload={"factory": "tests.factories:delayed", "args": {"delays": str(delays)}},
        space={"layout": "uniform", "choices": ["none", "full"]}, trials=2, confirm={"top": 0},
    )))
    return storage_url, delays


def test_confirmation_reorders_by_interleaved_medians(delayed_study, cli) -> None:  # type: ignore[no-untyped-def]
    storage, delays = delayed_study
    assert remat_search.best_plan("tiny", "1GiB", storage).summary() == "full×3"

    delays.write_text(json.dumps({"full×3": FULL_MS}))  # the busy spell is over; full still does more work
    result = cli("confirm", "--study", "tiny", "--storage", storage, "--rounds", "3")
    assert result.exit_code == 0, result.stderr
    best = remat_search.best_plan("tiny", "1GiB", storage)
    assert best.summary() == "none×3"
    assert best.confirmed is not None and len(best.confirmed.times) == 3
    assert best.confirmed.median < best.step_seconds  # confirmed faster than the search saw it
    # One time per plan: the confirmed ratio to the anchor (full remat, timed in the same rounds)
    # in the study's anchor seconds, the unit of every search time, in best, the front and show.
    report = remat_search.load_report("tiny", storage)
    full = next(t for t in report.trials if t.summary() == "full×3")
    assert best.time_source == "confirmed" and best.confirmed.anchor_times == full.confirmed.times
    assert best.seconds == pytest.approx(best.confirmed.anchor_ratio * best.measurement.anchor_seconds)
    assert best.seconds < best.step_seconds
    assert [t.number for t in report.front][-1] == best.number  # the front's fastest is best's answer
    assert min(t.seconds for t in report.front) == best.seconds
    rows = [line for line in result.stdout.splitlines() if "×3" in line]
    assert "none×3" in rows[0] and "full×3" in rows[1]  # ranked by the confirmed medians
    assert "≈" not in result.stdout  # 100 ms slower in every round: not within noise
    said = " ".join(result.stdout.split())
    assert "holds the true ratio with 75% probability" in said  # 3 rounds: 1 − 2/2³, not 95%
    assert "spread ±x%: half the (max − min) / median range of the repeats behind the step" in said

    stored = optuna.load_study(study_name="tiny", storage=storage).user_attrs["confirmation"]
    assert {s["session"] for s in stored.values()} == {best.confirmed.session}  # one interleaved session



def test_confirmation_re_times_the_presets_beside_the_top(tmp_path: Path, storage_url: str, cli) -> None:  # type: ignore[no-untyped-def]
    delays = tmp_path / "delays.json"
    delays.write_text(json.dumps({"full×3": 40}))  # the search timed full remat in a busy spell
    remat_search.run(parse_spec(spec_dict(
        storage_url, workload={"factory": "tests.factories:delayed", "args": {"delays": str(delays)}},
        space={"layout": "per_layer", "choices": ["none", "full"]}, trials=5, confirm={"top": 0},
    )))
    delays.write_text("{}")

    ranked = sorted(remat_search.load_report("tiny", storage_url).timed(), key=lambda t: t.step_seconds)
    top = {t.summary() for t in ranked[:2]}
    assert ranked[-1].summary() == "full×3"  # last by its search median: not in the top 2
    result = cli("confirm", "--study", "tiny", "--storage", storage_url, "--top", "2", "--rounds", "2", "--races", "0")
    assert result.exit_code == 0, result.stderr
    confirmed = {t.summary() for t in remat_search.load_report("tiny", storage_url).trials if t.confirmed}
    assert confirmed == {*top, "none×3", "full×3"}  # the top 2 and both presets (each fits), no race
    _, shown = remat_search.confirm_study(
        "tiny", top=2, rounds=2, presets=False, races=0, storage=storage_url, budget=2**30 - 1,
    )  # another budget: a session of its own, which keeps the plans re-timed before
    assert {t.summary() for t in shown} == confirmed

def test_plan_predicts_and_measures_on_request(tmp_path: Path, storage_url: str, cli) -> None:  # type: ignore[no-untyped-def]
    delays = tmp_path / "delays.json"
    delays.write_text(json.dumps({"full×3": 30}))  # full remat is slow, mixes are not
    report = remat_search.run(parse_spec(spec_dict(
        storage_url, workload={"factory": "tests.factories:delayed", "args": {"delays": str(delays)}},
        space={"layout": "per_layer", "choices": ["none", "full"]}, trials=2, confirm={"top": 0},
    )))
    none, full = (next(t.peak_bytes for t in report.trials if t.labels[0] == c) for c in ("none", "full"))
    budget = str(int(full + 0.6 * (none - full)))  # room to save all but one of the first two layers

    predicted = cli("plan", "--study", "tiny", "--budget", budget, "--storage", storage_url)
    assert predicted.exit_code == 0, predicted.stderr
    assert "not measured yet" in predicted.stderr
    plan = remat_search.RematPlan.from_json(
        cli("plan", "--study", "tiny", "--budget", budget, "--storage", storage_url, "--json").stdout
    )
    assert [p.kind for p in plan.layers].count("full") == 1  # the least remat predicted to fit…
    assert plan.layers[-1].kind == "none"  # …never on the last layer, which would save nothing

    measured = cli("plan", "--study", "tiny", "--budget", budget, "--storage", storage_url, "--measure")
    assert measured.exit_code == 0, measured.stderr
    study = optuna.load_study(study_name="tiny", storage=storage_url)
    assert len(study.trials) == 3  # the planned plan became one more trial
    trial = next(t for t in remat_search.load_report("tiny", storage_url).trials if t.number == 2)
    assert trial.plan == plan and trial.status == "measured"
    assert "measured" in measured.stdout and "not measured yet" not in measured.stderr

    above = cli("plan", "--study", "tiny", "--budget", "2GiB", "--storage", storage_url, "--measure")
    assert above.exit_code == 2 and "above the study's budget" in above.stderr
    assert len(optuna.load_study(study_name="tiny", storage=storage_url).trials) == 3  # nothing measured

    nothing_fits = cli("plan", "--study", "tiny", "--budget", "1KiB", "--storage", storage_url)
    assert nothing_fits.exit_code == 1 and "no plan is predicted to fit" in nothing_fits.stderr


def test_a_study_made_again_under_its_name_takes_its_old_measurements_from_the_cache(storage_url: str) -> None:
    # Deleted and made again (a benchmark run afresh, `optuna delete-study`): the cache's
    # measurements name the old study's trials, which share the new trials' numbers. They are
    # cache hits from that study, never a trial's reuse of itself.
    spec = spec_dict(storage_url, space={"layout": "uniform", "choices": ["none", "full"]}, trials=2, confirm={"top": 0})
    remat_search.run(parse_spec(spec))
    optuna.delete_study(study_name="tiny", storage=storage_url)
    again = remat_search.run(parse_spec(spec))
    assert [(t.reused_from, t.cached_from) for t in again.trials] == [(None, "tiny#0"), (None, "tiny#1")]
    assert len(again.timed()) == 2


@pytest.mark.parametrize("anchor", [True, False])
def test_timing_against_the_anchor_cancels_a_busy_spell(tmp_path: Path, storage_url: str, anchor: bool) -> None:
    """`none` is timed while the machine is busy (+400 ms on every step), `full` (100 ms slower
    in truth) after: alone, the busy spell ranks full first; against the anchor, none. The
    delays are far above what a loaded host adds to the tiny MLP's steps (40 and 10 ms were not:
    with both cores busy, an anchored pair once came out 0.5 ms the other way)."""
    delays = tmp_path / "delays.json"
    workload = {"factory": "tests.factories:delayed", "args": {"delays": str(delays)}}
    spec = spec_dict(
        storage_url, workload=workload, space={"layout": "uniform", "choices": ["none", "full"]},
        timing={"warmup": 1, "repeats": 3, "anchor": anchor}, confirm={"top": 0},
    )
    delays.write_text(json.dumps({"full×3": 100, "*": 400}))
    remat_search.run(parse_spec({**spec, "trials": 1}))  # the first preset, none×3
    delays.write_text(json.dumps({"full×3": 100}))
    report = remat_search.run(parse_spec({**spec, "trials": 2}))  # resumed: full×3

    seconds = {t.summary(): t.step_seconds for t in report.trials}
    assert (seconds["none×3"] < seconds["full×3"]) is anchor
    assert report.best(2**30).summary() == ("none×3" if anchor else "full×3")
    stored = optuna.load_study(study_name="tiny", storage=storage_url).user_attrs
    assert ("anchor_seconds" in stored) is anchor
    if anchor:  # the anchor's time in the busy spell is the study's unit: both plans are in it
        assert stored["anchor_seconds"] > 0.400
        assert all(len(t.measurement.anchor_times) == 3 for t in report.trials)


def test_a_study_that_anchors_times_again_what_was_timed_alone_and_keeps_it(
    tmp_path: Path, storage_url: str
) -> None:
    log = tmp_path / "traces.log"
    common = {"workload": {"factory": "tests.factories:counting", "args": {"log": str(log)}},
              "space": {"layout": "uniform", "choices": ["none", "full"]}, "trials": 2, "confirm": {"top": 0}}
    alone = remat_search.run(parse_spec(spec_dict(
        storage_url, study="alone", timing={"warmup": 1, "repeats": 2, "anchor": False}, **common,
    )))
    assert all(not t.measurement.anchor_times for t in alone.trials)
    anchored = remat_search.run(parse_spec(spec_dict(storage_url, study="anchored", **common)))
    assert all(t.cached_from is None and len(t.measurement.anchor_times) == 2 for t in anchored.trials)
    before = len(_compiled(log))
    again = remat_search.run(parse_spec(spec_dict(storage_url, study="again", **common)))
    assert {t.cached_from for t in again.trials} == {f"anchored#{t.number}" for t in anchored.trials}
    assert len(_compiled(log)) == before  # the anchored measurements replaced those timed alone


CPU = DeviceInfo(
    target="local", platform="cpu", device_kind="cpu", device_count=1, mesh=None, memory_limit=None, executes=True,
    jax_version="0.10.2", workload_fingerprint="w", program_fingerprint="p", measurement_schema=MEASUREMENT_SCHEMA,
)


def test_a_cached_measurement_is_judged_again_as_the_worker_judges_never_rewritten(tmp_path: Path) -> None:
    dots = RematPlan.uniform("dots", 3)  # under dots, this workload's gradients are twice full remat's
    m = measure(Executables(miscomputing()), dots, budget=2**40, timing=TimingConfig(warmup=1, repeats=2),
                gradient_tolerance=10.0)
    assert m.status == "measured" and m.grad_rel_error == pytest.approx(1.0, rel=1e-5) and len(m.step_times) == 2
    assert m == judge(m.raw, budget=2**40, gradient_tolerance=10.0)  # the worker's verdict is judge's
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'cache.db'}")
    cache.create_table(engine)
    cache.store(engine, CPU, m, study="s", trial=0)
    with engine.connect() as connection:
        cached = connection.execute(sa.select(cache.measurements.c.measurement)).scalar_one()
    assert not {"status", "error", "anchor_seconds"} & json.loads(cached).keys()  # raw only: no verdict
    hit = cache.lookup(engine, CPU, dots.digest)
    assert hit is not None and hit.raw.model_dump_json() == cached
    peak = hit.raw.peak_bytes
    cases = {"a smaller budget": (peak - 1, 10.0, "over_budget"), "a larger budget": (2 * peak, 10.0, "measured"),
             "a tighter tolerance": (2 * peak, 1e-3, "failed"), "the measured threshold": (2 * peak, None, "failed")}
    for case, (budget, tolerance, verdict) in cases.items():
        assert not cache.measure_again(hit.raw, budget=budget, repeats=2, anchored=True), case
        judged = judge(hit.raw, budget=budget, gradient_tolerance=tolerance)
        assert judged.status == verdict, case
        assert judged.raw.model_dump_json() == cached, case  # the raw part as cached, byte for byte
    over = judge(hit.raw, budget=peak - 1, gradient_tolerance=10.0)
    assert over.step_seconds is None and over.spread is None  # over this study's budget: no step time in it
    failed = judge(hit.raw, budget=2 * peak, gradient_tolerance=1e-3)
    assert "from full remat's by 1 (norm-relative; worst array" in failed.error and failed.step_seconds is None
    engine.dispose()


def test_a_cached_measurement_is_measured_again_only_where_it_cannot_be_judged() -> None:
    memory = MemoryBreakdown(argument=100, output=0, alias=0, temp=0, generated_code=0)
    compiled = RawMeasurement(plan_digest="p", memory=memory)  # over an earlier budget: never ran
    alone = compiled.model_copy(update={"time_source": "measured", "step_times": (0.1,) * 3, "loss": 1.0})
    anchored = alone.model_copy(update={"anchor_times": (0.2,) * 3})
    estimated = compiled.model_copy(update={"time_source": "estimated", "estimated_seconds": 0.1})
    oom = RawMeasurement(plan_digest="p", oom_required_bytes=10**12, oom_temp_bytes=10**12, oom_available_bytes=100)

    def again(raw: RawMeasurement, budget: int = 100, repeats: int = 3, anchored: bool = True) -> bool:
        return cache.measure_again(raw, budget=budget, repeats=repeats, anchored=anchored)

    assert again(compiled) and not again(compiled, budget=99)  # it now fits, so it must run
    with pytest.raises(ValueError, match="never ran"):
        judge(compiled, budget=100, gradient_tolerance=1)
    assert again(alone) and not again(alone, anchored=False) and not again(anchored)
    assert again(anchored, repeats=4)  # fewer repeats than the study asks for
    assert not again(estimated) and judge(estimated, budget=100, gradient_tolerance=1).step_seconds == 0.1
    assert not again(oom, budget=10**13)  # the compiler's own out-of-memory is final
    assert judge(oom, budget=10**13, gradient_tolerance=1).status == "over_budget"
    assert again(RawMeasurement(plan_digest="p"))  # never compiled


def test_the_cache_keeps_the_measurement_that_tells_most(tmp_path: Path) -> None:
    memory = MemoryBreakdown(argument=100, output=0, alias=0, temp=0, generated_code=0)
    compiled = Measurement(status="over_budget", plan_digest="p", memory=memory)
    alone = compiled.model_copy(update={"status": "measured", "time_source": "measured", "step_times": (0.1,) * 3})
    anchored = alone.model_copy(update={"anchor_times": (0.2,) * 3})
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'cache.db'}")
    cache.create_table(engine)
    for m, kept in ((compiled, compiled), (alone, alone), (compiled, alone), (anchored, anchored), (alone, anchored),
                    (anchored.model_copy(update={"step_times": (0.1,) * 5, "anchor_times": (0.2,) * 5}), None)):
        cache.store(engine, CPU, m, study="s", trial=0)
        assert cache.lookup(engine, CPU, "p").raw == (kept or m).raw
    engine.dispose()


def test_a_locked_cache_is_an_error_not_a_miss(tmp_path: Path) -> None:
    path = tmp_path / "cache.db"
    engine = sa.create_engine(f"sqlite:///{path}", connect_args={"timeout": 0.1})
    assert cache.lookup(engine, CPU, "p") is None  # no table yet: nothing cached
    cache.create_table(engine)
    memory = MemoryBreakdown(argument=100, output=0, alias=0, temp=0, generated_code=0)
    cache.store(engine, CPU, Measurement(status="over_budget", plan_digest="p", memory=memory), study="s", trial=0)
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # another process writing, for longer than the busy timeout
    try:
        with pytest.raises(sa.exc.OperationalError, match="database is locked"):
            cache.lookup(engine, CPU, "p")  # not a miss, which would compile the plan again
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert cache.lookup(engine, CPU, "p").study == "s"
    engine.dispose()


def test_a_measurement_of_another_schema_or_compiler_is_not_reused(tmp_path: Path) -> None:
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'cache.db'}")
    cache.create_table(engine)
    tpu = DeviceInfo(
        target="v5e:2x2", platform="tpu", device_kind="TPU v5 lite", device_count=4, mesh={"data": 4},
        memory_limit=2**34, executes=False, jax_version="0.10.2", workload_fingerprint="w", program_fingerprint="p",
        compiler_version="0.0.42.1", measurement_schema=MEASUREMENT_SCHEMA,
    )
    memory = MemoryBreakdown(argument=1, output=0, alias=0, temp=0, generated_code=0)
    m = Measurement(status="over_budget", plan_digest="plan", memory=memory)
    cache.store(engine, tpu, m, study="s", trial=0)
    assert cache.lookup(engine, tpu, "plan")[:3] == (m.raw, "s", 0)
    flags = '{"LIBTPU_INIT_ARGS": "--xla_tpu_host_transfer_overlap_limit=24", "XLA_FLAGS": "", "options": {}}'
    for changed in ({"measurement_schema": MEASUREMENT_SCHEMA - 1}, {"compiler_version": "0.0.43"},
                    {"compiler_options": flags}):
        assert cache.lookup(engine, tpu.model_copy(update=changed), "plan") is None, changed
    engine.dispose()


def test_the_worker_keys_measurements_by_this_schema_and_the_compilers_flags(
    storage_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # docs/tpu.md: the workers compile under the LIBTPU_INIT_ARGS remat-search runs with, and
    # their measurements are keyed on them (the flag is one libtpu knows: it reads them here too).
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_host_transfer_overlap_limit=24")
    with Runner(parse_spec(spec_dict(storage_url)).workload, timeout=120) as runner:
        device = runner.describe()
    assert device.measurement_schema == MEASUREMENT_SCHEMA and device.compiler_version is None  # CPU: XLA in jaxlib
    assert "remat_search" not in device.compiler_options  # the package's version says nothing of its measurements
    assert json.loads(device.compiler_options)["LIBTPU_INIT_ARGS"] == "--xla_tpu_host_transfer_overlap_limit=24"
    # ... but they are not the study's identity: a study resumes under other flags (docs/tpu.md says so)
    from remat_search.search.study import DEVICE_IDENTITY

    assert "compiler_options" not in DEVICE_IDENTITY


def test_a_worker_keeps_the_most_recently_used_executables_and_the_anchor(tmp_path: Path) -> None:
    log = tmp_path / "traces.log"
    executables = Executables(counting(str(log)), capacity=2)
    assert Executables(counting(str(log))).capacity == KEPT_EXECUTABLES == 64  # as README says
    none, dots, attn = (RematPlan.uniform(p, 3) for p in ("none", "dots", "dots_no_batch"))
    anchor = anchor_plan(3)
    for plan in (anchor, none, dots, none, attn, anchor, none):  # dots, least recently used, goes
        assert executables.build(plan).executable is not None
    assert _compiled(log) == [anchor.digest, none.digest, dots.digest, attn.digest]
    executables.build(dots)
    assert _compiled(log)[-1] == dots.digest  # dropped, so compiled again


def test_a_confirmed_plan_shows_one_time_in_every_command(delayed_study, cli) -> None:  # type: ignore[no-untyped-def]
    storage, delays = delayed_study
    delays.write_text(json.dumps({"full×3": FULL_MS}))
    assert cli("confirm", "--study", "tiny", "--storage", storage, "--rounds", "3").exit_code == 0
    best = remat_search.best_plan("tiny", "1GiB", storage)
    shown = format_seconds(best.seconds)
    assert best.time_source == "confirmed" and shown != format_seconds(best.step_seconds)
    outputs = {
        "best": cli("best", "--study", "tiny", "--budget", "1GiB", "--storage", storage).stdout,
        "pareto": cli("pareto", "--study", "tiny", "--storage", storage).stdout,
        "show": cli("show", "--study", "tiny", "--storage", storage).stdout,
        "show --trial": cli("show", "--study", "tiny", "--trial", str(best.number), "--storage", storage).stdout,
        "studies": cli("studies", "--storage", storage).stdout,
    }
    for command, text in outputs.items():
        assert shown in text, command
        if command not in ("best", "show --trial"):  # those add the trial's full account, search time named as such
            assert format_seconds(best.step_seconds) not in text, command  # no second time for the plan
    for command in ("best", "pareto", "show"):
        assert f"{shown} ✓" in outputs[command] and "✓ confirmed" in " ".join(outputs[command].split()), command
    for command in ("best", "show --trial"):
        assert f"its one time, in every table and the plot: {shown} ✓ (its confirmed time)" in outputs[command]


def test_the_compiler_s_packages_key_the_cache_and_the_saved_reference() -> None:
    """The worker records jaxlib's version (XLA), beside libtpu's for TPU and the CUDA plugin's
    for GPU; a measurement or a reference made with other versions is not reused. The saved
    reference is also keyed by the state's shardings, as the cache is."""
    import importlib.metadata

    from remat_search.measure.artifacts import reference_key
    from remat_search.measure.device import compiler_packages, reference_parts

    from tests.factories import TINY_MLP

    with Runner(TINY_MLP, timeout=120) as r:
        described = r.describe()
    assert described.compiler_packages == f"jaxlib {importlib.metadata.version('jaxlib')}"
    assert compiler_packages("tpu").startswith("jaxlib ")  # and libtpu's, where installed
    other_jaxlib = described.model_copy(update={"compiler_packages": "jaxlib 0.0.1"})
    assert cache.cache_key(other_jaxlib, "plan") != cache.cache_key(described, "plan")
    assert reference_key(reference_parts(other_jaxlib, 2)) != reference_key(reference_parts(described, 2))
    resharded = described.model_copy(update={"sharding_digest": "another"})
    assert reference_key(reference_parts(resharded, 2)) != reference_key(reference_parts(described, 2))


def test_a_trial_two_searches_popped_at_once_carries_no_mark_of_reuse_and_an_older_study_s_does(
    storage_url: str,
) -> None:
    """Two searches on PostgreSQL may pop one queued trial at once (optuna's ``ask``): the one
    that waited on the claim finds the other's measurement of this very trial, kept after the
    trial started, and takes it as the trial's own, with no ``reused_from``/``cached_from``; a
    measurement a deleted study of the same name kept for its trial of that number, before this
    trial started, is marked as cached from there."""
    import time

    from remat_search.search import reuse
    from remat_search.search.space import Space
    from remat_search.search.state import SearchState
    from remat_search.store.attributes import CACHED_ATTR, REUSED_ATTR
    from remat_search.store.storage import open_storage

    spec = parse_spec(spec_dict(storage_url, timing={"warmup": 1, "repeats": 2, "anchor": False}, confirm={"top": 0}))
    storage = open_storage(storage_url, create=True)
    cache.create_table(storage.engine)
    plan = RematPlan.uniform("full", 2)
    memory = MemoryBreakdown(argument=100, output=0, alias=0, temp=0, generated_code=0)
    m = judge(RawMeasurement(plan_digest=plan.digest, memory=memory, time_source="measured", step_times=(0.1, 0.1),
                             loss=1.0), budget=2**30)

    def search() -> tuple[SearchState, optuna.Trial]:
        study = optuna.create_study(study_name="tiny", storage=storage, directions=["minimize", "minimize"])
        state = SearchState(spec, 2**30, study, Space.of(spec.space, 2), storage, CPU, lambda p: None)
        return state, study.ask()

    _, trial = search()  # a study of this name whose trial 0 kept its measurement, then deleted
    cache.store(storage.engine, CPU, m, study="tiny", trial=trial.number)
    optuna.delete_study(study_name="tiny", storage=storage)
    time.sleep(0.05)
    state, trial = search()
    found = reuse.stored(state, trial, plan)
    assert found.cached_from == "tiny#0" and trial.user_attrs[CACHED_ATTR] == "tiny#0"

    optuna.delete_study(study_name="tiny", storage=storage)
    state, trial = search()
    with storage.engine.begin() as connection:  # kept now, by the other search measuring this very trial
        connection.execute(cache.measurements.update().values(
            measurement=m.raw.model_copy(update={"step_times": (0.2, 0.2)}).model_dump_json(),
            created=datetime.datetime.now(datetime.UTC).replace(tzinfo=None), study="tiny", trial=trial.number))
    found = reuse.stored(state, trial, plan)
    assert found.measurement is not None and found.measurement.step_times == (0.2, 0.2)
    assert found.reused_from is None and found.cached_from is None
    assert not {REUSED_ATTR, CACHED_ATTR} & set(trial.user_attrs)


def _make_tables(url: str, start: float) -> None:
    """One search's start: wait for the others, then make the cache's tables."""
    import time

    time.sleep(max(0.0, start - time.time()))
    cache.create_table(sa.create_engine(url, connect_args={"timeout": 30}))


def test_searches_that_start_at_once_all_make_the_cache_s_tables(tmp_path: Path) -> None:
    """Six processes make the tables of one new SQLite file at the same instant, eight files
    over: SQLite refuses every "CREATE TABLE" but the first, once a table, and none of them fails."""
    import concurrent.futures
    import multiprocessing
    import time

    with concurrent.futures.ProcessPoolExecutor(6, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(time.sleep, [0.1] * 6))  # every process started before the race
        for n in range(8):
            url = f"sqlite:///{tmp_path / f'{n}.db'}"
            start = time.time() + 0.2
            for done in [pool.submit(_make_tables, url, start) for _ in range(6)]:
                done.result()
            assert set(sa.inspect(sa.create_engine(url)).get_table_names()) == {
                t.name for t in (cache.measurements, cache.programs, cache.claims)}
