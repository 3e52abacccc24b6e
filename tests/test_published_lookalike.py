"""``benchmarks/published_lookalike.py``'s own arithmetic: the models it rebuilds and the FLOP
counts it turns MaxText's published figures into, against what MaxText printed."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import published_lookalike as pc  # noqa: E402


def test_the_flop_count_gives_back_the_tflops_maxtext_logged() -> None:
    # MaxText's logs (tpu-recipes): 4.546 s a step at 417.397 TFLOP/s (Llama 3.1 8B), 9.052 s
    # at 402.274 (Llama 2 70B); the same count over the logged step gives the logged rate.
    runs = {r.name: r for r in pc.RUNS}
    assert pc.maxtext_tflops(runs["v6e-llama3.1-8b"]) / 4.546 == pytest.approx(417.397, rel=1e-3)
    assert pc.maxtext_tflops(runs["v6e-llama2-70b"]) / 9.052 == pytest.approx(402.274, rel=1e-3)
    # MaxText's v5e table: TFLOP/s to 3 figures, MFU to 4, each row the one over the v5e's 197
    # TFLOP/s peak to the rounding (61.10% of 197 is 120.37); the step is read from the MFU.
    for name in ("v5e-16b", "v5e-32b", "v5e-64b"):
        run = runs[name]
        assert round(run.mfu * 197) == run.tflops
        assert run.published_step() == pytest.approx(pc.maxtext_tflops(run) / (run.mfu * 197))
    assert runs["v5e-16b"].published_step() == pytest.approx(10.626, abs=1e-3)


@pytest.mark.parametrize("name", list(pc.MODELS))
def test_each_model_has_the_parameters_its_count_says(name: str) -> None:
    # MaxText's 2023 count (6N) takes N from the parameter tree: the rebuilt model's tree holds
    # that many, its norms aside (a layer's one, two where attention and MLP are sequential, and a
    # final one, each the width).
    model = pc.MODELS[name]
    workload = pc.workload(name, batch=1, seq_len=128)
    shapes = jax.eval_shape(workload.init_params, jax.random.key(0))
    total = sum(a.size for a in jax.tree.leaves(shapes))
    norms = ((1 if model.parallel else 2) * model.layers + 1) * model.emb
    assert total - norms == model.params()


def test_the_kept_studies_say_what_the_docs_say() -> None:
    # README and docs/benchmarks.md: 3 of the 5 published configurations beaten by ≥ 5% estimated
    # throughput (the searches, libtpu's default flags); 3 of 5 estimates within ±15% of the
    # published step, 4 with the v5e's leave-one-out correction (v6e's is not applied),
    # compiled with the flags MaxText ran each run with (their own studies); read
    # from the studies benchmarks/published_lookalike.py kept (results/studies/published_lookalike.db).
    import json

    import remat_search
    from remat_search.measure.measurement import MEASUREMENT_SCHEMA

    storage = f"sqlite:///{Path(pc.__file__).parent / 'results' / 'studies' / 'published_lookalike.db'}"
    gains, ratios, default, flagged_gains = {}, {}, {}, {}
    for run in pc.RUNS:
        report, flagged = (remat_search.load_report(name, storage) for name in pc.study_names(run))
        # The search: libtpu's defaults, but for the VMEM the v6e runs' attention blocks need.
        assert json.loads(report.device["compiler_options"])["LIBTPU_INIT_ARGS"] == run.search_flags
        # Measured as today's worker measures (the step-time model of this checkout): a change of
        # the model bumps the schema, and the page's figures must be made again with it.
        assert report.device["measurement_schema"] == flagged.device["measurement_schema"] == MEASUREMENT_SCHEMA
        assert json.loads(flagged.device["compiler_options"])["LIBTPU_INIT_ARGS"] == run.xla_flags
        mine, found, timed = pc.published_trial(run, report), pc.answer(report), pc.published_trial(run, flagged)
        assert mine is not None and mine.seconds is not None and found is not None and timed is not None
        gains[run.name] = found.throughput / mine.throughput - 1
        ratios[run.name] = timed.seconds / run.published_step()
        default[run.name] = mine.seconds / run.published_step()
        one, other = mine.measurement.estimate, timed.measurement.estimate
        if run.chip == "v5e":  # docs: the v5e runs' flags leave their estimates as they were, to the millisecond
            assert abs(timed.seconds - mine.seconds) < 1e-3
        else:  # docs: on v6e the flags change the host wait, not the collectives (SparseCore's included)
            assert other.collective_seconds == pytest.approx(one.collective_seconds, rel=0.01)
            assert other.host_wait_seconds < one.host_wait_seconds
        again = next(t for t in flagged.trials if t.plan == found.plan and t.status != "waiting")
        flagged_gains[run.name] = again.throughput / timed.throughput - 1 if again.throughput else again.status
    assert sorted(name for name, gain in gains.items() if gain >= 0.05) == [
        "v5e-32b", "v6e-llama2-70b", "v6e-llama3.1-8b"]
    assert gains["v5e-16b"] == 0  # its answer is the published configuration
    assert 0 < gains["v5e-64b"] < 0.05
    assert sorted(name for name, r in ratios.items() if pc.within(r)) == [
        "v5e-32b", "v5e-64b", "v6e-llama3.1-8b"]
    corrected, _ = pc.leave_one_out([(run, None) for run in pc.RUNS], ratios)
    assert sorted(corrected) == ["v5e-16b", "v5e-32b", "v5e-64b"]
    assert sorted(name for name, r in ratios.items() if pc.within(corrected.get(name, r))) == [
        "v5e-16b", "v5e-32b", "v5e-64b", "v6e-llama3.1-8b"]
    assert sorted(name for name, r in default.items() if pc.within(r)) == ["v5e-32b", "v5e-64b", "v6e-llama2-70b"]
    # Under MaxText's flags the same three are beaten by >= 5% (the 70B's answer, full remat,
    # fits under them too).
    assert sorted(n for n, g in flagged_gains.items() if not isinstance(g, str) and g >= 0.05) == [
        "v5e-32b", "v6e-llama2-70b", "v6e-llama3.1-8b"]


def test_the_host_link_sweep_estimated_the_studies_programs_again() -> None:
    # docs/benchmarks.md: each candidate of each study under MaxText's flags that fits the HBM,
    # compiled again and estimated at each host link (results/published_lookalike_links.json): at
    # the model's own 15 GB/s it is the estimate the study stored, to the bit (the same
    # program); a faster link never makes a step slower; the v5e runs do not move with it. At 15
    # GB/s 3 of 5 published configurations are beaten by >= 5%, at 32 and 64 GB/s 2 (the 70B's
    # full remat falls under 5%), and both v6e estimates fall further below their published step.
    import json

    import remat_search

    storage = f"sqlite:///{Path(pc.__file__).parent / 'results' / 'studies' / 'published_lookalike.db'}"
    links = json.loads(pc.LINKS.read_text())
    assert sorted(links) == sorted(run.name for run in pc.RUNS)
    own = f"{pc.HOST_LINKS[0]:.0f}"
    beaten: dict[float, int] = {}
    ratios: dict[str, list[float]] = {}
    for run in pc.RUNS:
        flagged = remat_search.load_report(pc.study_names(run)[1], storage)
        assert set(links[run.name]) == set(pc.fitting(flagged))
        for summary, seconds in ((t.summary(), t.step_seconds) for t in flagged.trials if t.step_seconds is not None):
            by_link = [links[run.name][summary][f"{link:.0f}"] for link in pc.HOST_LINKS]
            assert links[run.name][summary][own] == seconds
            assert by_link == sorted(by_link, reverse=True)
            if run.chip == "v5e":
                assert len(set(by_link)) == 1
        mine = links[run.name][pc.published_trial(run, flagged).summary()]
        for link in pc.HOST_LINKS:
            key = f"{link:.0f}"
            best = min(candidate[key] for candidate in links[run.name].values())
            beaten[link] = beaten.get(link, 0) + (mine[key] / best - 1 >= 0.05)
            if run.chip == "v6e":
                ratios.setdefault(run.name, []).append(mine[key] / run.published_step())
    assert list(beaten.values()) == [3, 2, 2]
    for by_link in ratios.values():
        assert by_link == sorted(by_link, reverse=True) and len(set(by_link)) == 3
