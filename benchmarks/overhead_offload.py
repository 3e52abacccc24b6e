"""The overhead curve with offload among the choices: host memory instead of recomputation.

One command, from any machine with libtpu (``pip install -e '.[tpu,plot]'``), after
``python benchmarks/overhead.py --attention flash`` has kept its studies:

    python benchmarks/overhead_offload.py

``benchmarks/overhead.py`` found that with flash attention no plan of its seven choices (none,
full, dots, dots_no_batch and three sets of saved names) cuts 40% of no remat's activations for
5% or less: past ``dots`` every byte saved is a recomputed matmul, at least about +9%. Offload
pays for a saved byte with the host link instead (each offloaded tensor goes to pinned host
memory and back), which the step-time model now prices (``targets.step_time``: the chip's host
link, overlapped with the compute scheduled between a transfer's start and its done).

This compiles, for the same configuration (``search_spaces/v5e-writeup.yaml`` with flash
attention, ``v5e:2x4``), each choice that offloads (:data:`OFFLOADS`: one policy for every
layer); then a planner study at the −40% budget over ``none``, ``dots`` and those choices
proposes :data:`PROPOSALS` per-layer plans of its own. It compiles again every plan the kept
studies compiled (``results/studies/overhead-flash.db``: their plans, not their estimates,
which are the step-time model's of their day) and sets the offloading plans beside them: their
saving, estimated overhead, the bytes they move over the host link and how long computation
waits for them; and the best plan at each cut with offload included. Writes
``results/overhead_offload.md`` and ``results/overhead_offload.png``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import optuna
from overhead import CUTS
from search_quality import markdown
from search_quality_tpu import fresh_storage, search, versions

import remat_search
from remat_search.search.loop import measure_params
from remat_search.targets.chips import TPU_HOST_BYTES_PER_SECOND
from remat_search.units import format_bytes

HERE = Path(__file__).resolve().parent
SPEC = HERE.parent / "search_spaces" / "v5e-writeup.yaml"
KEPT = HERE / "results" / "studies" / "overhead-flash.db"
QKV = ["query_proj", "key_proj", "value_proj"]
OFFLOADS = [
    {"label": "offload_qkv", "offload": QKV},
    {"label": "offload_attn", "offload": ["context", "out_proj"]},
    {"label": "offload_mlp", "offload": ["mlpwi", "mlpwo"]},
    {"label": "offload_all", "offload": [*QKV, "context", "out_proj", "mlpwi", "mlpwo"]},
    {"label": "qkv_on_device_mlp_offloaded", "per_name": {"device": QKV, "offload": ["mlpwi", "mlpwo"]}},
    {"label": "dots_but_mlpwi_offloaded", "per_name": {"device": [*QKV, "context", "out_proj", "mlpwo"],
                                                       "offload": ["mlpwi"]}},
]
"""The offloading choices, one policy for every layer (MaxText's ``qkv_proj_offloaded`` is the
first; ``qkv_on_device_mlp_offloaded`` keeps q, k, v on the device and sends the MLP's to the
host; the last keeps every named tensor but the MLP's widest, which it offloads: ``dots`` with
its largest saved tensor on the host)."""
PROPOSALS = 4
"""The planner's own per-layer proposals at the −40% budget, over ``none``, ``dots`` and the first
five of :data:`OFFLOADS`."""


def main() -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if not KEPT.exists():
        raise SystemExit(f"{KEPT} is missing: run python benchmarks/overhead.py --attention flash first")
    spec = remat_search.load_spec(SPEC)
    began = time.perf_counter()
    kept = [remat_search.load_report(s.study_name, f"sqlite:///{KEPT}")
            for s in optuna.get_all_study_summaries(f"sqlite:///{KEPT}")]
    storage = fresh_storage(HERE / "results" / "studies" / "overhead-offload.db", keep_cache=True)
    workload = spec.workload.model_copy(update={"attention": "flash"}).model_dump()
    common = {"target": spec.target.model_dump(), "mesh": spec.mesh}
    plans = compiled_again(storage, workload, [c.model_dump() for c in spec.space.choices], common,
                           unique([t for r in kept for t in r.trials if t.status == "measured"]))
    none = next(t for t in plans if set(t.labels) == {"none"})
    temp = none.measurement.memory.temp
    uniform = search(storage, "offload-uniform", workload, ["none", *OFFLOADS], layout="uniform",
                     trials=1 + len(OFFLOADS), sampler="random", **common)
    choices = ["none", "dots", *OFFLOADS[:5]]
    planner = search(storage, "offload-planner-0.40", workload, choices, budget=int(peak(none) - 0.4 * temp),
                     trials=len(choices) + PROPOSALS, sampler="planner", **common)
    offloaded = unique([t for r in (uniform, planner) for t in r.trials if t.seconds is not None and any(
        p.host_memory for p in t.plan.layers)])
    every = plans + offloaded

    def saved(t: remat_search.TrialResult) -> float:
        return (peak(none) - peak(t)) / temp

    def overhead(t: remat_search.TrialResult) -> float:
        return t.seconds / none.seconds - 1

    rows = []
    for t in sorted(offloaded, key=lambda t: -saved(t)):
        e = t.measurement.estimate
        rows.append({
            "plan": t.summary(), "peak / chip": format_bytes(peak(t)), "saved": f"{saved(t):.0%}",
            "est. step": f"{t.seconds * 1e3:.1f} ms", "overhead": f"{overhead(t):+.1%}",
            "host link: bytes": format_bytes(int(e.host_bytes)), "link busy": f"{e.host_seconds * 1e3:.1f} ms",
            "compute waits": f"{e.host_wait_seconds * 1e3:.1f} ms",
            "host memory": format_bytes(t.measurement.memory.host_total),
        })
    cuts = []
    for cut in CUTS:
        budget = int(peak(none) - cut * temp)
        best = min((t for t in plans if peak(t) <= budget), key=lambda t: t.seconds, default=None)
        with_offload = min((t for t in every if peak(t) <= budget), key=lambda t: t.seconds, default=None)
        cuts.append({
            "cut": f"−{cut:.0%}", "budget": format_bytes(budget),
            "best without offload": f"{best.summary()} ({overhead(best):+.1%})" if best else "none fits",
            "best with offload": f"{with_offload.summary()} ({overhead(with_offload):+.1%})" if with_offload else "none fits",
        })
    text = "\n".join([
        f"# The overhead curve with offload ({SPEC.name}, flash attention, {spec.target.topology})\n",
        (f"Command: `python benchmarks/overhead_offload.py{' ' + ' '.join(sys.argv[1:]) if sys.argv[1:] else ''}`; "
        f"{versions(uniform)}; {(time.perf_counter() - began) / 60:.0f} min. Host link "
        f"{TPU_HOST_BYTES_PER_SECOND / 1e9:.0f} GB/s a chip one way (step_time.TPU_HOST_BYTES_PER_SECOND, an "
        f"assumption: Google publishes no figure), transfers overlapped with the compute between their start and "
        f"done. Peaks are the compiler's (`peak_memory_in_bytes`, the figure a TPU chip holds to), also for "
        f"the kept studies' plans, whose own reports took the larger breakdown sum. No remat: "
        f"{format_bytes(peak(none))} peak, {format_bytes(temp)} activations, est. step "
        f"{none.seconds * 1e3:.1f} ms. The kept studies' {len(plans)} plans compiled again (today's model "
        f"estimates them), {len(offloaded)} offloading plans compiled.\n"),
        "## The offloading plans\n", markdown(rows),
        "## The best plan at each cut, without and with offload\n", markdown(cuts),
        "## The front of every plan (least memory first)\n",
        markdown([{"plan": t.summary(), "peak": format_bytes(peak(t)), "saved": f"{saved(t):.0%}",
                   "est. step": f"{t.seconds * 1e3:.1f} ms", "overhead": f"{overhead(t):+.1%}"} for t in front(every)]),
        "![saved vs overhead](overhead_offload.png)\n",
    ])
    out = HERE / "results" / "overhead_offload.md"
    out.write_text(text)
    plot(plans, offloaded, saved, overhead, HERE / "results" / "overhead_offload.png")
    print(text + f"\nwrote {out}")


def compiled_again(
    storage: str, workload: dict, choices: list, common: dict, kept: list[remat_search.TrialResult]
) -> list[remat_search.TrialResult]:
    """The kept studies' plans compiled again, each a trial of one per-layer study over their
    choices: their estimates as today's step-time model makes them."""
    search(storage, "kept-plans", workload, choices, layout="per_layer", trials=1, sampler="random", **common)
    study = optuna.load_study(study_name="kept-plans", storage=storage)
    for t in kept:
        measure_params(study, storage, {f"layer_{i:02d}": label for i, label in enumerate(t.labels)})
    report = remat_search.load_report("kept-plans", storage)
    return unique([t for t in report.trials[1:] if t.status == "measured" and t.seconds is not None])


def peak(t: remat_search.TrialResult) -> int:
    """The compiler's peak a chip (the kept studies' trials were measured when reports took the
    larger of it and the breakdown sum)."""
    memory = t.measurement.memory
    return memory.compiler_peak if memory.compiler_peak is not None else t.peak_bytes


def front(trials: list[remat_search.TrialResult]) -> list[remat_search.TrialResult]:
    """The plans no other is both smaller (by :func:`peak`) and faster than, least memory first."""
    found: list[remat_search.TrialResult] = []
    for t in sorted(trials, key=lambda t: (peak(t), t.seconds)):
        if not found or t.seconds < found[-1].seconds:
            found.append(t)
    return found


def unique(trials: list[remat_search.TrialResult]) -> list[remat_search.TrialResult]:
    first: dict[str, remat_search.TrialResult] = {}
    for t in trials:
        first.setdefault(t.plan.digest, t)
    return list(first.values())


def plot(plans, offloaded, saved, overhead, path: Path) -> None:  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    ax.scatter([100 * saved(t) for t in plans], [100 * overhead(t) for t in plans], s=12, color="grey",
               label="recomputing (overhead.py's plans)")
    ax.scatter([100 * saved(t) for t in offloaded], [100 * overhead(t) for t in offloaded], s=30, marker="^",
               color="C3", label="offloading")
    for t in offloaded:
        ax.annotate(t.labels[0], (100 * saved(t), 100 * overhead(t)), textcoords="offset points", xytext=(4, 4),
                    fontsize=7)
    best = front(plans + offloaded)
    ax.step([100 * saved(t) for t in best], [100 * overhead(t) for t in best], where="pre", color="C0", label="front")
    for cut in CUTS:
        ax.axvline(100 * cut, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xlabel("activation memory saved: peak cut / no remat's temp bytes (%)")
    ax.set_ylabel("estimated step overhead vs no remat (%)")
    ax.set_yscale("symlog", linthresh=20)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    main()
