"""`remat-search run` as a separate process, as a user (or CI, or nohup) runs it: what it prints."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import TINY_TRANSFORMER, run_process, spec_dict, write_spec


@pytest.fixture(scope="module")
def tiny_search(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """The output (stdout and stderr, a pipe: not a terminal) of one search of a tiny spec with
    a budget in decimal units, and the spec."""
    folder = tmp_path_factory.mktemp("run")
    spec = write_spec(folder / "spec.yaml", spec_dict(
        f"sqlite:///{folder / 'studies.db'}", budget="1gb", trials=6, workload={**TINY_TRANSFORMER, "layers": 4},
        sampler={"kind": "random", "seed": 0},  # after the 4 presets, 2 mixed plans: long summaries
    ))
    search = run_process("run", str(spec))
    log = search.communicate(timeout=300)[0]
    assert search.returncode == 0, log
    return log, spec


@pytest.fixture
def tiny_run(tiny_search: tuple[str, Path]) -> str:
    return tiny_search[0]


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu prints these only where installed")
def test_a_cpu_search_prints_no_libtpu_warnings(tiny_run: str) -> None:
    """With libtpu installed (the test extra), JAX's probe for TPUs made libtpu print these."""
    for noise in LIBTPU_NOISE:
        assert noise not in tiny_run, tiny_run


LIBTPU_NOISE = ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "INVALID_ARGUMENT", "libtpu")


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu prints these only where installed")
def test_a_cpu_search_of_an_nnx_model_prints_no_libtpu_warnings(tmp_path: Path) -> None:
    """The search builds an NNX model's shapes before any worker starts: JAX's backends started
    there, and libtpu printed its five lines (the search's, not the worker's)."""
    from tests.workloads.test_nnx import WORKLOAD

    spec = write_spec(tmp_path / "spec.yaml", spec_dict(
        f"sqlite:///{tmp_path / 'studies.db'}", workload=WORKLOAD, space={"layout": "uniform", "choices": ["full"]},
        trials=1, confirm={"top": 0},
    ))
    search = run_process("run", str(spec))
    out = search.communicate(timeout=300)[0]
    assert search.returncode == 0, out
    assert not [noise for noise in LIBTPU_NOISE if noise in out], out


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="TPU targets need libtpu")
def test_a_tpu_target_search_prints_no_libtpu_warnings_and_keeps_no_compilation_cache(tmp_path: Path) -> None:
    """libtpu, asked for a topology on a host without TPUs, warned of the host it could not find;
    and it wrote JAX's persistent cache entries that it could not read back ("PjRtCompiler must
    be constructed with a Client"): a TPU target's worker keeps no such cache."""
    cache = tmp_path / "jax-cache"
    spec = write_spec(tmp_path / "spec.yaml", spec_dict(
        f"sqlite:///{tmp_path / 'studies.db'}", space={"layout": "uniform", "choices": ["full"]}, trials=1,
        target={"platform": "tpu", "topology": "v5e:2x2"}, compilation_cache=str(cache),
    ))
    for _ in range(2):  # the second would have read the first's entries
        search = run_process("run", str(spec))
        log = search.communicate(timeout=300)[0]
        assert search.returncode == 0, log
        for noise in ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "INVALID_ARGUMENT", "libtpu", "compilation cache"):
            assert noise not in log, log
        (tmp_path / "studies.db").unlink()
    assert not cache.exists()


def test_ctrl_c_says_the_run_was_interrupted_and_how_to_resume(tmp_path: Path, storage_url: str) -> None:
    """Ctrl-C in a terminal signals the whole process group: the search and its worker
    (started as from a terminal, Ctrl-C handled: :data:`tests.conftest.AS_FROM_A_TERMINAL`)."""
    started = tmp_path / "hanging"
    spec = write_spec(tmp_path / "spec.yaml", spec_dict(
        storage_url, trials=2, space={"layout": "uniform", "choices": ["none", "full"]},
        workload={"factory": "tests.factories:hanging", "args": {"started": str(started)}},
    ))
    search = run_process("run", str(spec), stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not started.exists():  # until a trial's step is running (and hangs)
            assert search.poll() is None, search.communicate()
            assert time.monotonic() < deadline, "no step ran"
            time.sleep(0.2)
        # How the search takes signals, for the message should it not stop: SigBlk, SigIgn, SigCgt
        takes = [line for line in Path(f"/proc/{search.pid}/status").read_text().splitlines() if line.startswith("Sig")]
        os.killpg(search.pid, signal.SIGINT)
        try:
            stdout, stderr = search.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the search did not stop on SIGINT; its signals then: {'; '.join(takes)}")
    finally:  # however it failed: no search left running for the next test of this worker
        if search.poll() is None:
            os.killpg(search.pid, signal.SIGKILL)
            search.communicate()
    assert search.returncode == 130, stdout + stderr
    assert stderr.splitlines() == [
        f"interrupted: finished trials are kept, and the same command resumes the study: remat-search run {spec}"
    ], stderr


def test_the_budget_is_echoed_as_understood(tiny_run: str) -> None:
    assert tiny_run.splitlines()[0] == "budget 1gb = 953.7 MiB"  # decimal gigabytes: said so, first


def test_another_budget_for_the_study_is_refused_in_the_units_it_was_written(  # type: ignore[no-untyped-def]
    cli, tiny_search: tuple[str, Path], tmp_path: Path
) -> None:
    spec = yaml.safe_load(tiny_search[1].read_text())
    result = cli("run", str(write_spec(tmp_path / "spec.yaml", {**spec, "budget": "1GiB"})))
    assert result.exit_code == 2, result.stdout + result.stderr
    assert result.stdout.splitlines()[0] == "budget 1GiB"  # an exact binary size: nothing to add
    assert result.stderr == (
        "error: spec.budget: study 'tiny' already exists with another budget (1GB); give this search a new "
        "study name\n"
    )


@pytest.mark.parametrize("columns", [80, 200])
def test_show_fits_the_terminal_and_cuts_no_cell(
    tiny_search: tuple[str, Path], columns: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At 80 columns the low-value columns go and the plan wraps between labels; at 200 all show."""
    spec = yaml.safe_load(tiny_search[1].read_text())
    monkeypatch.setenv("COLUMNS", str(columns))  # the process's terminal width
    show = run_process("show", "--study", "tiny", "--storage", spec["storage"])
    out = show.communicate(timeout=60)[0]
    assert show.returncode == 0, out
    lines = out.splitlines()
    assert "…" not in out and max(map(len, lines)) <= columns, out
    header = next(line for line in lines if "┃ trial" in line)
    assert ("spread" in header and "XLA GFLOP" in header) == (columns == 200), header
    assert ("which counts a loop's body once" in " ".join(out.split())) == (columns == 200), out  # said what it counts
    rows: dict[int, list[list[str]]] = {}  # trial → its lines' cells
    for line in lines:
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if cells and cells[0].isdigit():
            rows[int(cells[0])] = []
        if cells and rows:
            rows[max(rows)].append(cells)
    assert sorted(rows) == list(range(6))
    for number, row in rows.items():
        plan = " ".join(cells[1] for cells in row).split()
        assert all(re.fullmatch(r"(none|full|dots|save_attn)(×\d)?", label) for label in plan), (number, plan)
        assert row[0][-1] in ("measured", "over_budget"), row  # the status word, whole
        assert len(row) <= (3 if columns == 80 else 1), row  # wrapped between labels, not one label a line


def test_output_to_a_pipe_has_a_line_a_trial_and_the_confirmation(tiny_run: str) -> None:
    """Not a terminal (CI, nohup): one line a trial as it finishes, then the confirmation phase."""
    lines = tiny_run.splitlines()
    assert lines[1] == "study tiny: 0/6 trials done; compiling for local = 1× cpu"
    trial_lines = [line for line in lines if line.startswith("trial ")]
    assert len(trial_lines) == 6, tiny_run
    for done, line in enumerate(trial_lines, 1):
        assert re.fullmatch(
            rf"trial {done - 1} \({done}/6\) [\w×. ]+: measured, peak [\d.]+ [KM]iB, step [\d.]+ ms", line
        ), line
    confirming = lines.index("confirming 2 plans × 2 rounds, interleaved in one worker…")
    assert lines.index(trial_lines[-1]) < confirming < next(i for i, line in enumerate(lines) if "Pareto" in line)


def test_run_and_show_say_what_attention_auto_became(cli, tiny_search: tuple[str, Path]) -> None:  # type: ignore[no-untyped-def]
    """The spec leaves attention at ``auto``: the run's header and ``show`` say it is dense on this CPU."""
    line = "attention: auto → dense (on cpu, flash would be XLA's composition, which keeps the scores too)"
    assert tiny_search[0].splitlines()[2] == line
    storage = yaml.safe_load(tiny_search[1].read_text())["storage"]
    shown = cli("show", "--study", "tiny", "--storage", storage)
    assert shown.exit_code == 0, shown.stdout + shown.stderr
    assert line in shown.stdout.splitlines()


def test_a_rerun_and_a_confirm_say_the_stored_results_are_reused(cli, tiny_search: tuple[str, Path]) -> None:  # type: ignore[no-untyped-def]
    spec = yaml.safe_load(tiny_search[1].read_text())
    rerun = cli("run", str(tiny_search[1]))
    assert rerun.exit_code == 0, rerun.stdout + rerun.stderr
    assert "all 6 trials of the spec are stored: nothing to measure" in rerun.stdout
    # 2 plans, or more where the search's confirmation raced (a plan it had not re-timed ranked first)
    reused = re.compile(r"confirmation: these \d+ plans were re-timed together before \(2 rounds\): their stored times stand")
    assert reused.search(rerun.stdout) and "trial 0" not in rerun.stdout
    confirm = cli("confirm", "--study", "tiny", "--top", "2", "--rounds", "2", "--no-presets",
                  "--storage", spec["storage"])
    assert confirm.exit_code == 0, confirm.stdout + confirm.stderr
    assert reused.match(confirm.stdout), confirm.stdout


def test_in_a_terminal_the_bar_shows_the_plan_being_measured(
    tiny_search: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One more trial of a copy of the study, as a terminal shows it (TTY_COMPATIBLE: rich draws its bar)."""
    spec = yaml.safe_load(tiny_search[1].read_text())
    for db in tiny_search[1].parent.glob("studies.db*"):
        shutil.copy(db, tmp_path)
    spec.update(trials=7, storage=f"sqlite:///{tmp_path / 'studies.db'}", confirm={**spec["confirm"], "top": 3})
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    search = run_process("run", str(write_spec(tmp_path / "spec.yaml", spec)))
    out = search.communicate(timeout=300)[0]
    assert search.returncode == 0, out
    assert re.search(r"trial 6: (compiling and timing|reusing the measurement of) [\w×. ]+", out), out
    # The top 3 re-timed with the plans re-timed before, or, where the search's confirmation had
    # raced and re-timed them all already, its session standing: either way the bar says which.
    session = re.search(r"confirming (\d+) plans × 2 rounds|these (\d+) plans were re-timed together before", out)
    assert session and int(session[1] or session[2]) >= 3, out
