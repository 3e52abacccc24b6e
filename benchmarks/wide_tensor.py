"""Where the step-time model's time goes when a tensor axis widens from 8 to 16 ways (a TPU v5p).

    python benchmarks/wide_tensor.py --compile   # compile the probes (MaxText, libtpu; a few minutes)
    python benchmarks/wide_tensor.py             # price the kept programs and write the page

No calibration sample has a ``tensor`` axis wider than 8, and published runs at 16 ways that the
project has never used read slower by the model than MaxText ran them (issue 47). Those runs stay
out of this benchmark: it never compiles nor prices them. It takes one published run instead, the
2023 128B on v5p-128 (``fsdp`` 16 × ``tensor`` 8, ``minimal``: a calibration sample), and compiles
the same model, chips and global batch at ``fsdp`` 8 × ``tensor`` 16 and with ``full``, then prices
each program at the v5 calibration (``published_programs/v5.json``) and at two what-ifs: every
collective free (what the collectives add), and each ``collective-permute`` over two links where
the model prices one. A second fit of the same six samples with the HBM held at the datasheet's
(the v5 fit's HBM figure, 0.566, is the one that is far from the chip's) says whether the penalty
rests on that figure. Writes ``benchmarks/results/wide_tensor.md``; keeps the probes' programs in
``benchmarks/results/wide_tensor/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

from published_configs import (  # benchmarks/ is the script's folder
    FULL,
    MINIMAL,
    PROGRAMS,
    RUNS,
    Run,
    keep_programs,
    label,
)

from remat_search.targets.calibration import chip_of, fit, load_calibration, load_samples, read_program
from remat_search.targets.step_time import Efficiencies, StepEstimate, price
from remat_search.targets.work import Work, read_work

HERE = Path(__file__).resolve().parent
KEPT = HERE / "results" / "wide_tensor"
PAGE = HERE / "results" / "wide_tensor.md"
BASE = "v5p-128b"
MESHES = [({"fsdp": 16, "tensor": 8}, FULL), ({"fsdp": 8, "tensor": 16}, MINIMAL), ({"fsdp": 8, "tensor": 16}, FULL)]
"""The probes: the published run's model, chips and global batch at these meshes and policies."""


def probes() -> list[Run]:
    """The probe runs (:data:`MESHES`), named ``v5p-128b-f8t16-minimal`` and so on."""
    base = next(r for r in RUNS if r.name == BASE)
    return [dataclasses.replace(base, name=f"{BASE}-f{m['fsdp']}t{m['tensor']}-{label(c)}", mesh=m, choices=[c], meshes=[],
                                trials=1) for m, c in MESHES]


def programs() -> dict[str, tuple[str, Path]]:
    """Each program to price, by name: the published configuration's (the calibration's own
    sample) and the probes' kept ones, with a description."""
    found = {BASE: ("fsdp=16,tensor=8 · minimal (published)", PROGRAMS / f"{BASE}.hlo.gz")}
    for run, (mesh, choice) in zip(probes(), MESHES, strict=True):
        path = KEPT / f"{run.name}.hlo.gz"
        if path.exists():
            found[run.name] = (f"fsdp={mesh['fsdp']},tensor={mesh['tensor']} · {label(choice)}", path)
    return found


def v5_samples() -> tuple[list[Work], list, list[float]]:
    """The v5 calibration's samples: their programs' work, chips and published steps."""
    samples = [(s, path) for s, path in load_samples(PROGRAMS / "samples.json") if s.chip in ("v5e", "v5p")]
    chips = [chip_of(s.chip) for s, _ in samples]
    works = [read_work(read_program(path), c.mxu) for (_, path), c in zip(samples, chips, strict=True)]
    return works, chips, [s.measured_seconds for s, _ in samples]


def row(name: str, what: str, work: Work, figures: Efficiencies, hbm_at_datasheet: Efficiencies,
        reference: dict[str, float]) -> str:
    """One program's line of the page."""
    chip = chip_of("v5p")
    e: StepEstimate = price(work, chip, figures)
    free = price(work, chip, figures.model_copy(update={"ici": 1e6})).seconds
    two_links = price(work, chip.model_copy(update={"ici_links": chip.ici_links / 2}), figures).seconds
    other = price(work, chip, hbm_at_datasheet).seconds
    reference.setdefault("v5", e.seconds)
    reference.setdefault("hbm", other)
    return (f"| {what} | {e.seconds:.2f} s | **{e.seconds / reference['v5']:.3f}** | {e.compute_seconds:.2f} s | "
            f"{e.hbm_bytes / 1e12:.2f} TB | {e.collective_bytes / 1e9:.0f} GB | {e.seconds - free:.2f} s | {two_links:.2f} s | "
            f"{other / reference['hbm']:.3f} |")


def page() -> str:
    """The page: each kept program priced, and what the figures say."""
    works, chips, measured = v5_samples()
    calibration = load_calibration(PROGRAMS / "v5.json")
    figures = [f for f in calibration.fitted if f != "hbm"]
    hbm_at_datasheet = fit(works, chips, measured, figures)
    reference: dict[str, float] = {}
    rows = [row(name, what, read_work(read_program(path), 128), calibration.efficiencies, hbm_at_datasheet, reference)
            for name, (what, path) in programs().items()]
    e = calibration.efficiencies
    return "\n".join([
        "# A tensor axis of 16 on a v5p: where the model's time goes",
        "",
        "Command: `python benchmarks/wide_tensor.py` (its programs compiled by `--compile`: MaxText 0.2.5, libtpu "
        "0.0.50.1, on this 2-core machine). The 2023 128B of MaxText's v5p table, its published run on v5p-128 "
        "(2 × 2048 tokens a chip, `fsdp` 16 × `tensor` 8, `minimal`: a calibration sample) and the same model, "
        "chips and global batch compiled at the mesh and policy named. Every figure is an **estimate** of the "
        "step-time model, none a measurement: no TPU step at 16 ways was run, and the published runs at 16 ways "
        "are left out of this page (they are how the model is checked from outside).",
        "",
        f"Priced at the v5 calibration (`published_programs/v5.json`: matmuls at {e.matmul:.3f} of peak, HBM at "
        f"{e.hbm:.3f}, ICI at {e.ici:.3f}). Columns: the estimate; it over the published configuration's; the "
        "instructions' own time (the larger of matmul and HBM time, summed); HBM bytes and collective bytes a "
        "chip; what the collectives add (the estimate less the same with every collective free); the estimate "
        "with each `collective-permute` priced over two links, where the model prices one; and the estimate "
        "over the published configuration's under a refit of the same six samples with the HBM held at the "
        f"datasheet's (matmuls at {hbm_at_datasheet.matmul:.3f}, ICI at {hbm_at_datasheet.ici:.3f}).",
        "",
        "| program | estimate | / published config | instructions | HBM bytes | collective bytes | collectives add "
        "| permutes over two links | / published config, HBM at datasheet |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compile", action="store_true", help="compile the probes and keep their programs first")
    args = parser.parse_args()
    if args.compile:
        with tempfile.TemporaryDirectory() as scratch:
            keep_programs(probes(), KEPT, samples=False, db=Path(scratch) / "probes.db")
    PAGE.write_text(page())
    print(PAGE.read_text())


if __name__ == "__main__":
    main()
