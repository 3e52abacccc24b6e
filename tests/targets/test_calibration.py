"""Calibrations of the step-time model (``targets.calibration``): figures fitted to measured
steps, and the error measured leave-one-out. On the programs an H100 compiled and the steps it
took (benchmarks/results: gpu_step_time.json, its programs under hlo/, samples.json), kept as a
fixture; on measurements made from known figures; through the CLI and a TPU spec."""

from __future__ import annotations

import functools
import json
import math
import random
import re
import statistics
from pathlib import Path

import pytest
from scipy import stats

from remat_search.errors import SpecError
from remat_search.targets.calibration import (
    BAND_COVERAGE,
    Calibration,
    Fitted,
    calibrate,
    ceiling,
    chip_of,
    fit,
    load_calibration,
    load_samples,
    prediction_band,
    read_program,
)
from remat_search.targets.chips import GPUS, PUBLISHED_BANDS
from remat_search.targets.step_time import Efficiencies, estimate_step, price
from remat_search.targets.work import Work, read_work

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
H100 = RESULTS / "samples.json"


@functools.cache
def _work(path: Path, mxu: int | None = None) -> Work:
    """A kept program's work, read once a test process: reading is the slow part, and the
    published programs are priced by three kept calibrations (v5, v6e and all of them)."""
    return read_work(read_program(path), mxu)


@pytest.fixture(scope="module")
def h100() -> Calibration:
    """The calibration of the kept H100 measurements (two decoders × four plans)."""
    return calibrate(load_samples(H100), name="h100-kept", compiler="jaxlib (cuda)")


def test_figures_a_program_was_priced_at_are_recovered() -> None:
    """Steps made by pricing real programs at known figures are fitted back to those figures."""
    samples = load_samples(H100)
    works = [_work(path) for _, path in samples]
    chips = [GPUS["h100"]] * len(works)
    known = Efficiencies(matmul=0.61, hbm=0.83, host_link=0.7, launch_seconds=6e-6)
    measured = [price(w, c, known).seconds for w, c in zip(works, chips, strict=True)]
    found = fit(works, chips, measured, ("matmul", "hbm", "host_link", "launch_seconds"))
    for figure in ("matmul", "hbm", "host_link", "launch_seconds"):
        assert getattr(found, figure) == pytest.approx(getattr(known, figure), rel=1e-4), figure


def test_a_fit_never_reaches_past_what_the_chip_can_do() -> None:
    """Steps faster than the datasheet allows (matmuls at 1.5× the peak, a host link at 3× a PCIe
    Gen5 x16 link's) fit the datasheet's peak and the widest link, no further: a figure at its
    ceiling says the model prices something too dearly, and a fit that went past it would hide that."""
    samples = load_samples(H100)
    works = [_work(path) for _, path in samples]
    chips = [GPUS["h100"]] * len(works)
    assert (ceiling("matmul", chips), ceiling("hbm", chips), ceiling("host_link", chips)) == (1.0, 2.0, 1.0)
    assert ceiling("host_link", [chip_of("v6e")]) == pytest.approx(64e9 / 15e9)
    impossible = Efficiencies(matmul=1.5, hbm=0.8, host_link=3.0)
    measured = [price(w, c, impossible).seconds for w, c in zip(works, chips, strict=True)]
    found = fit(works, chips, measured, ("matmul", "hbm", "host_link"))
    assert found.matmul == pytest.approx(1.0) and found.host_link == pytest.approx(1.0)


def test_the_fit_changes_nothing_at_the_datasheet() -> None:
    """Uncalibrated figures price a program as the datasheet model always did."""
    _, path = load_samples(H100)[0]
    text = read_program(path)
    assert estimate_step(text, GPUS["h100"]).seconds == price(read_work(text), GPUS["h100"], Efficiencies()).seconds


def test_kept_h100_steps_are_estimated_within_5_percent_left_out(h100: Calibration) -> None:
    """Fitted on the others, every plan's estimate is within 5% of the step the H100 took:
    offloading plans too (the datasheet model had them at 0.64-0.66 of the step)."""
    assert {s.kind for s in h100.samples} == {"keep", "recompute", "offload"}
    for s in h100.samples:
        assert abs(s.loo_error) <= 0.05, (s.label, s.loo_seconds, s.measured_seconds)
    assert max(h100.errors().values()) <= 0.05


def test_calibrated_estimates_order_the_plans_as_the_h100_did(h100: Calibration) -> None:
    """Wherever two plans' measured steps differ by more than 5%, the calibrated estimates put
    them in the same order (left out too). Among them: offload_qkv behind none on d1024-L8,
    which the datasheet model had ahead."""
    pairs = [(a, b) for a in h100.samples for b in h100.samples if a.measured_seconds > 1.05 * b.measured_seconds]
    assert pairs
    for slower, faster in pairs:
        assert slower.calibrated_seconds > faster.calibrated_seconds, (slower.label, faster.label)
        assert slower.loo_seconds > faster.loo_seconds, (slower.label, faster.label)
    by = {s.label: s for s in h100.samples}
    assert by["d1024-L8-offload_qkv"].measured_seconds > 1.05 * by["d1024-L8-none"].measured_seconds


def test_offload_waits_for_its_transfers_on_a_gpu() -> None:
    """XLA:GPU runs an offload's copies on the kernels' stream: the step waits for all of the
    link's time (the datasheet model had 70% of it hidden), so offloading qkv is estimated
    behind keeping everything on d1024-L8, as the H100 measured."""
    by = {s.label: path for s, path in load_samples(H100)}
    offload = estimate_step(read_program(by["d1024-L8-offload_qkv"]), GPUS["h100"])
    assert offload.host_bytes == 2 * 768 * 2**20  # out in the forward pass, back in the backward
    assert offload.host_wait_seconds == pytest.approx(offload.host_seconds)
    assert offload.seconds > estimate_step(read_program(by["d1024-L8-none"]), GPUS["h100"]).seconds


def test_a_calibration_round_trips_and_states_its_band(h100: Calibration, tmp_path: Path) -> None:
    path = tmp_path / "h100.json"
    path.write_text(h100.model_dump_json())
    loaded = load_calibration(path)
    assert loaded == h100 and loaded.chips == ("h100",)
    low, high = loaded.band("offload") or (0.0, 0.0)
    offloads = [s.measured_seconds / s.loo_seconds for s in loaded.samples if s.kind == "offload"]
    assert len(offloads) < 3 and (low, high) == loaded.band()  # two offloading samples: every sample's band
    assert low < min(offloads) <= max(offloads) < high


def test_published_bands_are_the_pages(tmp_path: Path) -> None:
    """The uncalibrated band of each TPU generation is what published_configs.md measured: the
    prediction band of published step / estimate of the published configuration, a run's model
    its family (``v6e-llama3.1-8b-x16`` is ``llama3.1-8b``)."""
    page = (RESULTS / "published_configs.md").read_text()
    ratios: dict[str, list[tuple[float, str]]] = {}
    for run, generation, ratio in re.findall(r"^\| ((v\d\w*)-[^|]*?) \|.*?\| \*\*([\d.]+)\*\* \|", page, re.M):
        ratios.setdefault(generation, []).append((1 / float(ratio), re.sub(r"-x\d+$", "", run.split("-", 1)[1])))
    assert set(ratios) == set(PUBLISHED_BANDS) and len({f for _, f in ratios["v6e"]}) == 5
    for generation, (low, high) in PUBLISHED_BANDS.items():
        band = prediction_band([r for r, _ in ratios[generation]], [f for _, f in ratios[generation]])
        assert (low, high) == pytest.approx(band, abs=0.002)


def test_the_published_page_fits_every_published_run_and_leaves_each_family_out() -> None:
    """published_configs.md: MaxText ran every published configuration, and the TPU compiler
    compiled each for its chip, so each reads as fitting (a program that offloads is at most the
    HBM it was compiled for); each row gives its estimate left out alone and with its model's
    other runs, as the kept calibrations of its group hold them."""
    page = (RESULTS / "published_configs.md").read_text()
    rows = re.findall(r"^\| (v\d\w*-[^|]*?) \|.*?\| ([\d.]+ GiB of [\d.]+ GiB: [^|]*) \|.*?\| \*\*[\d.]+\*\* \| "
                      r"[\d.]+ s \| \*\*([\d.]+)\*\* \| ([\d.]+) \| [\d.]+ \|$", page, re.M)
    assert len(rows) == 19
    groups = {s.label: (s, name) for name in ("v5", "v6e")
              for s in load_calibration(RESULTS / "published_programs" / f"{name}.json").samples}
    for label, peak, loo, lofo in rows:
        assert peak.endswith(": fits"), (label, peak)
        sample, _ = groups[label]
        assert float(loo) == pytest.approx(sample.loo_seconds / sample.measured_seconds, abs=0.0006)
        assert sample.lofo_seconds is not None
        assert float(lofo) == pytest.approx(sample.lofo_seconds / sample.measured_seconds, abs=0.0006)
    families = {s.family for s, _ in groups.values()}
    assert {"llama3.1-8b", "llama3.1-70b", "2023-32b"} <= families and len(families) == 9


def test_bad_samples_name_the_field(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text(json.dumps([{"label": "x", "chip": "h100", "program": "p.hlo", "measured_seconds": -1,
                                                  "kind": "keep"}]))
    with pytest.raises(SpecError, match=r"^calibrate: samples file .*a.json \[0\].measured_seconds: Input should be greater than 0"):
        load_samples(tmp_path / "a.json")
    (tmp_path / "b.json").write_text(json.dumps([{"label": "x", "chip": "h9", "program": "p.hlo", "measured_seconds": 1,
                                                  "kind": "keep"}]))
    with pytest.raises(SpecError, match=r"^calibration: unknown chip 'h9'"):
        load_samples(tmp_path / "b.json")
    with pytest.raises(SpecError, match="unknown chip"):
        chip_of("tpu9")
    (tmp_path / "c.json").write_text(json.dumps([{"label": "x", "chip": "v5p", "program": "p.hlo", "measured_seconds": 1,
                                                  "kind": "keep", "mesh": {"tensor": "wide"}}]))
    with pytest.raises(SpecError, match=r"^calibrate: samples file .*c.json \[0\].mesh.tensor: Input should be a valid integer"):
        load_samples(tmp_path / "c.json")


def test_a_generation_without_published_runs_has_no_band() -> None:
    """Uncalibrated, a v5e estimate carries its published runs' band; a v4's none: its error is
    said to be unknown, not made up."""
    from remat_search.report.text import band_text
    from remat_search.targets.calibration import with_band
    from remat_search.targets.step_time import StepEstimate

    estimate = StepEstimate(seconds=1.0, compute_seconds=1.0, collective_seconds=0.0, flops=0.0, hbm_bytes=0.0,
                            collective_bytes=0.0, instructions=1)
    v5e, v4 = (with_band(estimate, None, "recompute", PUBLISHED_BANDS.get(g)) for g in ("v5e", "v4"))
    assert v5e.band == PUBLISHED_BANDS["v5e"]
    assert "by MaxText's published runs of this generation, a run takes 0.95–1.41× the model's estimate" in band_text(v5e)
    assert v4.band is None and band_text(v4).startswith("uncalibrated, its error unknown")


OUTSIDE: list[str] = []
"""The published runs whose left-out estimate by one calibration of all nineteen is off by more
than 15%: none since asynchronous collectives overlap computation (the v5e 64B read 1.156 before,
docs/benchmarks.md); by each chip group's calibration, none either."""


@pytest.mark.parametrize("kept", ["calibrations/h200.json", "calibrations/h100-kept.json",
                                  "published_programs/calibration.json", "published_programs/v5.json",
                                  "published_programs/v6e.json"])
def test_a_kept_calibration_prices_its_samples_as_it_says(kept: str) -> None:
    """The calibrations the docs quote (benchmarks/results) hold what this code computes: each
    sample's program priced at the kept figures is the kept calibrated step."""
    calibration = load_calibration(RESULTS / kept)
    folder = {"calibrations/h200.json": RESULTS / "gpu_step_time_h200", "calibrations/h100-kept.json": RESULTS}.get(
        kept, RESULTS / "published_programs")
    programs = {s.label: path for s, path in load_samples(folder / "samples.json")}
    for s in calibration.samples:
        chip = chip_of(s.chip)
        work = _work(programs[s.label], chip.mxu)
        assert price(work, chip, calibration.efficiencies).seconds == pytest.approx(s.calibrated_seconds, rel=1e-9)
        assert price(work, chip).seconds == pytest.approx(s.uncalibrated_seconds, rel=1e-9)
    chips = [chip_of(c) for c in calibration.chips]
    for figure in calibration.fitted:  # within what the chips can do (docs/step_time.md says where one sits at its ceiling)
        if figure != "launch_seconds":
            assert getattr(calibration.efficiencies, figure) <= ceiling(figure, chips) * (1 + 1e-9), figure
    if kept.startswith("calibrations/"):  # the GPUs: every plan within 4% left out (README says so)
        assert max(calibration.errors().values()) <= 0.04
    elif kept.endswith("calibration.json"):  # MaxText's published runs, one set of figures for all: OUTSIDE
        assert sorted(s.label for s in calibration.samples if abs(s.loo_error) > 0.15) == OUTSIDE
    else:  # a calibration of the chip's group (v5e with v5p; v6e): every published run within 15% left out
        assert max(abs(s.loo_error) for s in calibration.samples) <= 0.15


def test_the_h200_calibration_estimates_a_shape_it_never_saw_within_its_error() -> None:
    """d1536-L6, measured on the H200 after its calibration was fitted on d1024-L8 and d2048-L4:
    every plan's calibrated estimate within 2.2% of its measured step."""
    calibration = load_calibration(RESULTS / "calibrations" / "h200.json")
    assert not any(s.label.startswith("d1536") for s in calibration.samples)
    for s, path in load_samples(RESULTS / "gpu_step_time_h200_d1536" / "samples.json"):
        estimate = price(_work(path), chip_of(s.chip), calibration.efficiencies).seconds
        assert abs(estimate / s.measured_seconds - 1) <= 0.022, s.label


def test_a_family_is_left_out_together_and_the_band_is_read_from_it(tmp_path: Path) -> None:
    """Two plans of each of the H100's two decoders, a decoder a family: each sample's
    leave-one-family-out estimate is priced by the figures fitted on the other decoder's plans
    alone, its leave-one-out by the three others (its own decoder's other plan among them); the
    band is the families'."""
    from remat_search.targets.calibration import Sample

    chosen = ("d1024-L8-none", "d1024-L8-full", "d2048-L4-none", "d2048-L4-full")
    kept = [s for s in json.loads(H100.read_text()) if s["label"] in chosen]
    for s in kept:
        s["program"] = str(H100.parent / s["program"])
        s["family"] = s["label"].split("-")[0]  # d1024 / d2048
    (tmp_path / "samples.json").write_text(json.dumps(kept))
    samples = load_samples(tmp_path / "samples.json")
    calibration = calibrate(samples, name="h100-families", compiler="jaxlib (cuda)")
    assert calibration.families == 2
    works = {s.label: _work(path) for s, path in samples}
    for family in ("d1024", "d2048"):
        others = [(s, works[s.label]) for s, _ in samples if s.family != family]
        figures = fit([w for _, w in others], [GPUS["h100"]] * len(others), [s.measured_seconds for s, _ in others],
                      calibration.fitted)
        for s in calibration.samples:
            if s.family == family:
                assert s.lofo_seconds == pytest.approx(price(works[s.label], GPUS["h100"], figures).seconds, rel=1e-6)
                assert s.held_out_seconds == s.lofo_seconds
    # Two samples a kind, fewer than BAND_SAMPLES: each kind's band is every sample's, a prediction
    # interval over two families (one degree of freedom), so wide that it holds every ratio.
    logs = [math.log(s.measured_seconds / s.lofo_seconds) for s in calibration.samples]
    half = stats.t.ppf(0.975, 1) * statistics.stdev(logs) * math.sqrt(1 + 1 / 2)
    expected = (math.exp(statistics.fmean(logs) - half), math.exp(statistics.fmean(logs) + half))
    for kind in ("keep", "recompute"):
        assert calibration.band(kind) == pytest.approx(expected)  # type: ignore[arg-type]
    assert expected[0] < min(math.exp(x) for x in logs) and max(math.exp(x) for x in logs) < expected[1]
    # Without families each sample is its own: leave-one-family-out is leave-one-out.
    alone = calibrate([(Sample.model_validate({**s.model_dump(), "family": ""}), p) for s, p in samples[:3]],
                      name="h100", compiler="jaxlib (cuda)")
    assert alone.families == 3 and all(s.lofo_seconds == s.loo_seconds for s in alone.samples)
    assert all(s.lofo_seconds != s.loo_seconds for s in calibration.samples)  # a sibling no longer stands in


def _banded(ratios: list[float], families: list[str], kinds: list[str] | None = None) -> Calibration:
    """A calibration whose samples' measured / held-out estimate are ``ratios``, of ``families``."""
    samples = tuple(Fitted(label=f"s{i}", chip="v5e", kind=(kinds or ["recompute"] * len(ratios))[i], family=family,  # type: ignore[arg-type]
                           measured_seconds=r, uncalibrated_seconds=1.0, calibrated_seconds=1.0, loo_seconds=1.0,
                           lofo_seconds=1.0)
                    for i, (r, family) in enumerate(zip(ratios, families, strict=True)))
    return Calibration(name="t", chips=("v5e",), compiler="c", efficiencies=Efficiencies(), fitted=(), samples=samples)


def test_a_band_holds_a_new_models_step_as_often_as_it_says() -> None:
    """The band is a prediction interval: of models drawn as its samples were (a ratio each, log-normal),
    a new one lands inside it BAND_COVERAGE of the time (2,000 draws of six samples and one more),
    where the samples' lowest and highest ratio alone, the band before it, held (n - 1) / (n + 1)
    of them: 5 of 7."""
    draw = random.Random(0)
    inside = inside_range = 0
    for _ in range(2000):
        ratios = [math.exp(draw.gauss(0.0, 0.08)) for _ in range(7)]
        low, high = _banded(ratios[:6], [f"f{i}" for i in range(6)]).band("recompute") or (0.0, 0.0)
        inside += low <= ratios[6] <= high
        inside_range += min(ratios[:6]) <= ratios[6] <= max(ratios[:6])
    assert abs(inside / 2000 - BAND_COVERAGE) < 0.02, inside
    assert abs(inside_range / 2000 - 5 / 7) < 0.04, inside_range


def test_a_band_counts_families_not_runs_and_never_drops_a_sample() -> None:
    """The same six ratios read as three models run at two chip counts each give a wider band than
    as six models (a model's runs err together); no band leaves out one of its own samples; a kind
    of plan with three samples or more is banded by them alone, one with fewer by every sample;
    one sample has no band (no spread was measured)."""
    ratios = [0.95, 0.97, 1.0, 1.01, 1.04, 1.08]
    six, three = _banded(ratios, [f"f{i}" for i in range(6)]), _banded(ratios, ["a", "a", "b", "b", "c", "c"])
    (low6, high6), (low3, high3) = six.band(), three.band()  # type: ignore[misc]
    assert low3 < low6 < min(ratios) and max(ratios) < high6 < high3
    one_outlier = _banded([1.0] * 20 + [1.5], [f"f{i}" for i in range(21)])
    assert (one_outlier.band() or (0, 0))[1] == 1.5  # the interval alone would stop short of it
    kinds = ["recompute"] * 3 + ["offload"] * 2 + ["keep"]
    mixed = _banded([0.99, 1.0, 1.01, 0.8, 1.2, 1.0], [f"f{i}" for i in range(6)], kinds)
    assert mixed.band("recompute") != mixed.band() and mixed.band("offload") == mixed.band() == mixed.band("keep")
    assert (mixed.band("recompute") or (0, 0))[1] < (mixed.band() or (0, 0))[1]
    assert _banded([1.1], ["a"]).band() is None
