"""``remat-search calibrate`` and a spec that names its file: the step-time model fitted to
measured steps from a samples file or a study that ran, and a TPU study estimated with it, each
estimate carrying the band its calibration measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import remat_search
from remat_search.measure.measurement import Measurement
from remat_search.report.results import TrialResult
from remat_search.report.text import describe_trial, rivals
from remat_search.spec.loading import parse_spec
from remat_search.targets.calibration import Calibration, Fitted, load_calibration
from remat_search.targets.chips import PUBLISHED_BANDS
from remat_search.targets.step_time import Efficiencies
from tests.conftest import spec_dict, write_spec

H100 = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "samples.json"


def _some_h100_samples(tmp_path: Path, labels: tuple[str, ...]) -> Path:
    """A samples file of a few kept H100 samples, their programs named by absolute paths."""
    kept = [dict(s, program=str(H100.parent / s["program"])) for s in json.loads(H100.read_text()) if s["label"] in labels]
    path = tmp_path / "samples.json"
    path.write_text(json.dumps(kept))
    return path


def test_calibrate_a_samples_file(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    samples = _some_h100_samples(tmp_path, ("d2048-L4-none", "d2048-L4-full", "d2048-L4-offload_qkv", "d1024-L8-full"))
    out = tmp_path / "cal" / "h100.json"
    result = cli("calibrate", str(samples), "--name", "h100-test", "--compiler", "jaxlib 0.x (cuda)", "-o", str(out))
    assert result.exit_code == 0, result.stdout + result.stderr
    calibration = load_calibration(out)
    assert calibration.name == "h100-test" and calibration.chips == ("h100",) and calibration.compiler == "jaxlib 0.x (cuda)"
    assert [s.label for s in calibration.samples] == ["d1024-L8-full", "d2048-L4-none", "d2048-L4-full", "d2048-L4-offload_qkv"]
    assert set(calibration.fitted) == {"matmul", "hbm", "launch_seconds", "host_link"}
    for s in calibration.samples:  # every figure the table shows is the file's
        assert s.label in result.stdout and f"{s.loo_error:+.1%}" in result.stdout
    assert "with its model family left out, over 4 families" in result.stdout and f"wrote {out}" in result.stdout


def test_calibrate_a_study_that_ran_on_its_devices(cli, tmp_path: Path, storage_url: str, home: Path) -> None:  # type: ignore[no-untyped-def]
    """A study on ``target: local`` keeps each compiled program; calibrate fits on its timed trials
    (here CPU programs priced as an H100's: the plumbing, not a chip's figures)."""
    report = remat_search.run(parse_spec(spec_dict(
        storage_url, study="ran", trials=3, space={"layout": "uniform", "choices": ["none", "full", "dots"]},
        confirm={"top": 0})))
    timed = [t for t in report.trials if t.measurement is not None and t.measurement.time_source == "measured"]
    assert len(timed) >= 2
    kept = sorted(p.name for p in (home / "artifacts" / "ran" / "programs").glob("*.hlo.gz"))
    assert {f"{t.measurement.program_digest}.hlo.gz" for t in timed} <= set(kept)
    refused = cli("calibrate", "--study", "ran", "--storage", storage_url, "--name", "cpu")
    assert refused.exit_code == 2 and refused.stderr.count("\n") == 1
    assert "--chip: study 'ran' ran on cpu, which is not a chip the step-time model knows" in refused.stderr
    unknown = cli("calibrate", "--study", "ran", "--storage", storage_url, "--chip", "h9", "--name", "cpu")
    assert unknown.exit_code == 2 and unknown.stderr.count("\n") == 1
    assert "--chip: expected one of h100, h200, v4, v5e, v5p, v6e, got 'h9'" in unknown.stderr
    assert not (home / "calibrations").exists()
    result = cli("calibrate", "--study", "ran", "--storage", storage_url, "--chip", "h100", "--name", "cpu-as-h100")
    assert result.exit_code == 0, result.stdout + result.stderr
    calibration = load_calibration(home / "calibrations" / "cpu-as-h100.json")
    assert sorted(s.label for s in calibration.samples) == sorted(f"ran#{t.number}" for t in timed)
    by = {s.label: s for s in calibration.samples}
    for t in timed:
        assert by[f"ran#{t.number}"].measured_seconds == t.seconds and by[f"ran#{t.number}"].kind == t.plan.kind
    assert "jax" in calibration.compiler


def test_a_tpu_study_keeps_its_programs_where_the_spec_asks(cli, tmp_path: Path, home: Path) -> None:  # type: ignore[no-untyped-def]
    """A TPU topology's programs are only estimated: kept only with ``target.keep_programs``,
    and then, with steps measured elsewhere (here made up), a samples file calibrates on them."""
    space = {"layout": "uniform", "choices": ["full", "dots"]}
    for study, keep in (("estimated", False), ("kept", True)):  # each its own storage: no measurement reused
        target = {"platform": "tpu", "topology": "v5e:2x2", **({"keep_programs": True} if keep else {})}
        report = remat_search.run(parse_spec(spec_dict(f"sqlite:///{tmp_path / study}.db", study=study, trials=2,
                                                       confirm={"top": 0}, space=space, target=target)))
    assert not list((home / "artifacts" / "estimated").glob("programs/*"))
    digests = {t.measurement.program_digest for t in report.trials}
    kept = {p.name for p in (home / "artifacts" / "kept" / "programs").glob("*.hlo.gz")}
    assert len(digests) == 2 and kept == {f"{d}.hlo.gz" for d in digests}
    samples = [{"label": f"kept#{t.number}", "chip": "v5e", "program": str(home / "artifacts" / "kept" / "programs" /
                f"{t.measurement.program_digest}.hlo.gz"), "measured_seconds": 2 * t.seconds, "kind": t.plan.kind}
               for t in report.trials]
    (tmp_path / "samples.json").write_text(json.dumps(samples))
    result = cli("calibrate", str(tmp_path / "samples.json"), "--name", "v5e-kept", "-o", str(tmp_path / "v5e.json"))
    assert result.exit_code == 0, result.stdout + result.stderr
    calibration = load_calibration(tmp_path / "v5e.json")
    assert [s.label for s in calibration.samples] == [s["label"] for s in samples]
    for s, t in zip(calibration.samples, report.trials, strict=True):  # the fit explains twice the datasheet's steps
        assert s.uncalibrated_seconds == pytest.approx(t.seconds) and s.calibrated_seconds == pytest.approx(2 * t.seconds, rel=0.05)


@pytest.mark.parametrize(("args", "said"), [
    (("--name", "x"), "calibrate: no samples; name a SAMPLES.json file or --study"),
    (("missing.json", "--name", "x"), "calibrate: samples file missing.json: [Errno 2]"),
    (("--name", "bad name"), "--name: expected a name of letters, digits"),
    (("--study", "nosuch", "--name", "x"), "storage: no database at"),
])
def test_bad_calibrate_input_is_one_line_and_writes_nothing(  # type: ignore[no-untyped-def]
        cli, args: tuple[str, ...], said: str, home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = cli("calibrate", *args, "--storage", f"sqlite:///{tmp_path / 's.db'}")
    assert result.exit_code == 2, result.stdout + result.stderr
    assert result.stderr.count("\n") == 1 and said in result.stderr, result.stderr
    assert not (home / "calibrations").exists() and not (tmp_path / "s.db").exists()


def _v5e_calibration(path: Path) -> Calibration:
    """A calibration of v5e: its figures and the samples whose leave-one-out gave its bands."""
    calibration = Calibration(
        name="v5e-test", chips=("v5e",), compiler="libtpu (test)", fitted=("matmul", "hbm"),
        efficiencies=Efficiencies(matmul=0.5, hbm=0.8),
        samples=tuple(Fitted(label=f"s{i}", chip="v5e", kind=kind, measured_seconds=1.0, uncalibrated_seconds=0.7,
                             calibrated_seconds=1.0, loo_seconds=loo)
                      for i, (kind, loo) in enumerate([("recompute", 0.96), ("recompute", 1.02), ("keep", 0.99)])))
    path.write_text(calibration.model_dump_json())
    return calibration


def test_a_tpu_spec_names_a_calibration(cli, tmp_path: Path, storage_url: str) -> None:  # type: ignore[no-untyped-def]
    """Each estimate is priced at the calibration's figures and carries the band of its plan's
    kind; show says so, and best names the candidates within that band of its answer."""
    calibration = _v5e_calibration(tmp_path / "v5e.json")
    low, high = calibration.band("recompute") or (0.0, 0.0)
    assert (low, high) == calibration.band() and low < 1 / 1.02 and 1 / 0.96 < high  # two recomputing samples: every sample's
    target = {"platform": "tpu", "topology": "v5e:2x2", "calibration": str(tmp_path / "v5e.json")}
    plain = remat_search.run(parse_spec(spec_dict(storage_url, study="plain", trials=2, confirm={"top": 0},
                                                  space={"layout": "uniform", "choices": ["full", "dots"]},
                                                  target={"platform": "tpu", "topology": "v5e:2x2"})))
    report = remat_search.run(parse_spec(spec_dict(storage_url, study="cal", trials=2, confirm={"top": 0},
                                                   space={"layout": "uniform", "choices": ["full", "dots"]}, target=target)))
    assert report.device["target"] == "v5e:2x2, calibration v5e-test"
    for t, before in zip(report.trials, plain.trials, strict=True):
        e = t.measurement.estimate
        assert e.calibration == "v5e-test" and e.band == (low, high)
        assert t.seconds > before.seconds  # half the peak FLOP/s, 0.8 of the HBM's
        assert before.measurement.estimate.band == PUBLISHED_BANDS["v5e"] and before.measurement.estimate.calibration is None
        assert (f"calibrated (v5e-test): a model it never saw takes {low:.2f}–{high:.2f}× its estimate 95 times in 100"
                in describe_trial(t))
    shown = cli("show", "--study", "cal", "--storage", storage_url)
    assert shown.exit_code == 0 and f"cal. est. ×{low:.2f}-{high:.2f}" in shown.stdout
    best = cli("best", "--study", "cal", "--storage", storage_url, "--budget", "15GiB")
    close = rivals(min(report.trials, key=lambda t: t.seconds), report.trials)
    assert best.exit_code == 0
    assert ("within the estimate's error of" in best.stderr) == bool(close)


@pytest.mark.parametrize(("calibration", "said"), [
    ("nowhere.json", "spec.target.calibration: cannot read nowhere.json"),
    ("h100.json", "spec.target.calibration: h100.json was fitted on h100, not v5e"),
    ("spec.yaml", "spec.target.calibration: spec.yaml is not a calibration"),
])
def test_a_bad_calibration_is_one_line(  # type: ignore[no-untyped-def]
        cli, tmp_path: Path, storage_url: str, calibration: str, said: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    h100 = _v5e_calibration(tmp_path / "v5e.json").model_copy(update={"chips": ("h100",)})
    (tmp_path / "h100.json").write_text(h100.model_dump_json())
    spec = spec_dict(storage_url, target={"platform": "tpu", "topology": "v5e:2x2", "calibration": calibration})
    result = cli("run", str(write_spec(tmp_path / "spec.yaml", spec)))
    assert result.exit_code == 2, result.stdout + result.stderr
    assert result.stderr.count("\n") == 1 and said in result.stderr, result.stderr
    assert not list(tmp_path.glob("*.db*"))


def test_rivals_are_the_estimates_whose_bands_overlap() -> None:
    from remat_search.measure.measurement import Measurement, MemoryBreakdown
    from remat_search.targets.step_time import StepEstimate

    def trial(number: int, seconds: float, band: tuple[float, float] | None) -> TrialResult:
        estimate = StepEstimate(seconds=seconds, compute_seconds=seconds, collective_seconds=0, flops=0, hbm_bytes=0,
                                collective_bytes=0, instructions=1, band=band)
        m = Measurement(status="measured", plan_digest=str(number), time_source="estimated", estimated_seconds=seconds, estimate=estimate,
                        memory=MemoryBreakdown(argument=0, output=0, temp=1, alias=0, generated_code=0))
        return TrialResult(number=number, status="measured", measurement=m)

    best, near, far, unknown = trial(0, 1.0, (0.9, 1.1)), trial(1, 1.15, (0.9, 1.1)), trial(2, 1.3, (0.9, 1.1)), trial(3, 1.01, None)
    assert rivals(best, [best, near, far, unknown]) == [near]
    assert rivals(unknown, [best, near]) == []


def test_an_estimate_of_a_kind_no_sample_has_says_it_is_outside_them(tmp_path: Path) -> None:
    """The v5e calibration has plans that recompute and keep, none that offloads: an offloading
    plan's estimate carries every sample's band, marked as an extrapolation in show and in tables."""
    from remat_search.report.text import band_text, estimate_mark
    from remat_search.targets.calibration import with_band
    from remat_search.targets.step_time import StepEstimate

    calibration = _v5e_calibration(tmp_path / "v5e.json")
    estimate = StepEstimate(seconds=1.0, compute_seconds=1.0, collective_seconds=0.0, flops=0.0, hbm_bytes=0.0,
                            collective_bytes=0.0, instructions=1)
    within, offload = with_band(estimate, calibration, "recompute"), with_band(estimate, calibration, "offload")
    assert within.outside is None and offload.outside == "no sample offloads"
    low, high = offload.band or (0.0, 0.0)
    assert offload.band == calibration.band() == within.band  # recompute has two samples: every sample's band too
    assert f"takes {low:.2f}–{high:.2f}× its estimate" in band_text(offload) and "outside" not in band_text(within)
    assert band_text(offload).endswith("; outside its samples (no sample offloads): an extrapolation")

    def trial(e: StepEstimate) -> TrialResult:
        return TrialResult(number=0, status="measured", measurement=Measurement(
            status="measured", plan_digest="p", time_source="estimated", estimated_seconds=1.0, estimate=e))

    assert estimate_mark(trial(offload)) == f"cal. est. ×{low:.2f}-{high:.2f}, outside its samples"
    assert estimate_mark(trial(within)) == f"cal. est. ×{low:.2f}-{high:.2f}"


def test_an_estimate_over_a_tensor_axis_wider_than_any_samples_says_so() -> None:
    """MaxText's published v5p runs split tensors at most 8 ways (v5p-128b): a plan over 16 ways is
    outside them, calibrated (published_programs/v5.json, its samples' meshes) or not (the
    published runs' band); 8 ways, or an FSDP mesh of any size, is within."""
    from remat_search.report.text import band_text
    from remat_search.targets.calibration import with_band
    from remat_search.targets.chips import PUBLISHED_TENSOR
    from remat_search.targets.step_time import StepEstimate

    v5 = load_calibration(Path(__file__).resolve().parents[2] / "benchmarks/results/published_programs/v5.json")
    assert v5.widest_tensor == PUBLISHED_TENSOR["v5p"] == 8
    estimate = StepEstimate(seconds=1.0, compute_seconds=1.0, collective_seconds=0.0, flops=0.0, hbm_bytes=0.0,
                            collective_bytes=0.0, instructions=1)
    for calibration, band in ((v5, None), (None, PUBLISHED_BANDS["v5p"])):
        def marked(mesh: dict[str, int]) -> str | None:
            return with_band(estimate, calibration, "recompute", band, mesh=mesh,
                             uncalibrated_tensor=PUBLISHED_TENSOR["v5p"]).outside
        assert marked({"fsdp": 16, "tensor": 16}) == "tensors split 16 ways, no sample's more than 8"
        assert marked({"fsdp": 32, "tensor": 8}) is None and marked({"fsdp": 512}) is None
        assert marked({"fsdp": 8, "tensor": 4, "tensor_sequence": 4}) is not None
    wide = with_band(estimate, v5, "recompute", mesh={"fsdp": 16, "tensor": 16})
    assert band_text(wide).endswith("outside its samples (tensors split 16 ways, no sample's more than 8): an extrapolation")
