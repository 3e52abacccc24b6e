"""The step-time model calibrated on GPUs' measured steps, and its leave-one-out error.

    python benchmarks/gpu_calibration.py      # results/gpu_calibration.md, results/calibrations/*.json

For each set of programs an NVIDIA GPU compiled and ran (``gpu_step_time.py``'s ``samples.json``:
the kept H100 set, the H200 set of issue 38), :func:`remat_search.targets.calibration.calibrate`
fits the model's free figures on every sample and estimates each sample with the figures fitted on
the others (leave-one-out); the page gives every sample's measured step, the datasheet model's
estimate, the calibrated one and the left-out one, the error by kind of plan, and whether the
left-out estimates order the plans as the GPU did wherever the measured steps differ by more than
5%. No GPU is needed: the programs and steps are kept.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from remat_search.targets.calibration import Calibration, calibrate, chip_of, fit, load_samples, read_program
from remat_search.targets.step_time import price
from remat_search.targets.work import read_work

RESULTS = Path(__file__).resolve().parent / "results"
SETS = {
    "h100-kept": (RESULTS / "samples.json", "jaxlib (CUDA) of issue 26's run, NVIDIA H100 80GB HBM3"),
    "h200": (RESULTS / "gpu_step_time_h200" / "samples.json", "jax 0.11.2 (CUDA 13), NVIDIA H200"),
}


def ordered(calibration: Calibration) -> tuple[int, int]:
    """Pairs of samples whose measured steps differ by more than 5%, and how many of them the
    left-out estimates put in the measured order."""
    pairs = [(a, b) for a in calibration.samples for b in calibration.samples if a.measured_seconds > 1.05 * b.measured_seconds]
    return len(pairs), sum(a.loo_seconds > b.loo_seconds for a, b in pairs)


def section(calibration: Calibration) -> list[str]:
    e = calibration.efficiencies
    pairs, right = ordered(calibration)
    uncal = [s.uncalibrated_seconds / s.measured_seconds for s in calibration.samples]
    lines = [
        f"## {calibration.name}: {calibration.compiler}\n",
        "| sample | kind | measured | datasheet model | est. / meas. | calibrated | left out | left-out error |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
        *[f"| {s.label} | {s.kind} | {s.measured_seconds * 1e3:.1f} ms | {s.uncalibrated_seconds * 1e3:.1f} ms | "
          f"{s.uncalibrated_seconds / s.measured_seconds:.2f} | {s.calibrated_seconds * 1e3:.1f} ms | "
          f"{s.loo_seconds * 1e3:.1f} ms | {s.loo_error:+.1%} |" for s in calibration.samples],
        "",
        f"Datasheet model / measured: {min(uncal):.2f}–{max(uncal):.2f} (median {statistics.median(uncal):.2f}). "
        "Left-out error, largest by kind: "
        + ", ".join(f"{kind} {error:.1%}" for kind, error in calibration.errors().items())
        + f". Measured order kept by the left-out estimates in {right} of {pairs} pairs that differ by more than 5%.\n",
        f"Fitted on all: matmuls at {e.matmul:.3f} of the datasheet's dense bf16 FLOP/s, HBM traffic at {e.hbm:.3f} of its "
        f"bandwidth, host transfers at {e.host_link:.3f} of the link's 64 GB/s, {e.launch_seconds * 1e6:.1f} µs an "
        "instruction besides its work.\n",
    ]
    return lines


def across_models(samples: Path, fitted: tuple[str, ...]) -> list[str]:
    """Fitted on one model's plans only, each other model's plans estimated: how far a
    calibration carries beyond the shapes it saw (the left-out error above mixes both models)."""
    found = load_samples(samples)
    works = [read_work(read_program(path)) for _, path in found]
    chips = [chip_of(s.chip) for s, _ in found]
    models = sorted({s.label.rsplit("-", 1)[0] for s, _ in found})
    lines = ["| fitted on | estimated | errors (estimated / measured - 1) | one plan over another of that model |",
             "|---|---|---|---|"]
    for model in models:
        mine = [i for i, (s, _) in enumerate(found) if s.label.startswith(model + "-")]
        e = fit([works[i] for i in mine], [chips[i] for i in mine], [found[i][0].measured_seconds for i in mine], fitted)
        others = [i for i in range(len(found)) if i not in mine]
        errors = [price(works[i], chips[i], e).seconds / found[i][0].measured_seconds - 1 for i in others]
        lines.append(f"| {model} ({len(mine)} plans) | the other model's {len(others)} | "
                     f"{min(errors):+.1%} to {max(errors):+.1%} | {relative(errors):.1%} |")
    intro = ("Across models: fitted on one model's plans, the other model's estimated. The last column is the "
             "largest error of an estimated ratio of two plans' steps (one plan over another, of the model estimated): "
             "what a ranking of two plans of one model rests on, where the errors above are what a step's estimate "
             "rests on.\n")
    return [intro, *lines, ""]


def relative(errors: list[float]) -> float:
    """The largest error, over every pair of plans of one model, of the estimated ratio of their
    steps against the measured ratio (``(1 + e_i) / (1 + e_j) - 1`` for estimate errors ``e``):
    how far the model misjudges one plan against another, which the error the plans share cancels from."""
    return max(abs((1 + a) / (1 + b) - 1) for a in errors for b in errors)


UNSEEN = {"h200": RESULTS / "gpu_step_time_h200_d1536" / "samples.json"}
"""Programs measured after the calibration of the same GPU was fitted, of a shape it never saw."""


def unseen(calibration: Calibration, samples: Path) -> list[str]:
    """Each sample of ``samples`` estimated with ``calibration`` (fitted without it), against its
    measured step and the calibration's band for its kind."""
    lines = [f"Unseen: {samples.parent.name}, measured after the calibration was fitted, estimated with it:\n",
             "| sample | kind | measured | calibrated | error | its kind's band (measured / estimate) | inside |",
             "|---|---|---:|---:|---:|---|---|"]
    errors = []
    for s, path in load_samples(samples):
        estimate = price(read_work(read_program(path)), chip_of(s.chip), calibration.efficiencies).seconds
        low, high = calibration.band(s.kind) or (0.0, 0.0)
        ratio = s.measured_seconds / estimate
        errors.append(estimate / s.measured_seconds - 1)
        lines.append(f"| {s.label} | {s.kind} | {s.measured_seconds * 1e3:.1f} ms | {estimate * 1e3:.1f} ms | "
                     f"{errors[-1]:+.1%} | ×{low:.3f}–{high:.3f} | {'yes' if low <= ratio <= high else 'no'} |")
    return [*lines, "", f"One plan over another of this model, estimated against measured: at most {relative(errors):.1%} off.\n"]


def main() -> None:
    lines = ["# The step-time model calibrated on GPU steps: leave-one-out error\n",
             "Command: `python benchmarks/gpu_calibration.py` (no GPU needed: the programs and steps were kept by "
             "`gpu_step_time.py`). Each sample is estimated by the model fitted on the others; then each model's plans by the model fitted "
             "on the other model's alone.\n"]
    (RESULTS / "calibrations").mkdir(exist_ok=True)
    for name, (samples, compiler) in SETS.items():
        calibration = calibrate(load_samples(samples), name=name, compiler=compiler)
        (RESULTS / "calibrations" / f"{name}.json").write_text(calibration.model_dump_json(indent=1) + "\n")
        lines += section(calibration) + across_models(samples, calibration.fitted)
        if name in UNSEEN:
            lines += unseen(calibration, UNSEEN[name])
        print("\n".join(lines[-20:]), flush=True)
    (RESULTS / "gpu_calibration.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
