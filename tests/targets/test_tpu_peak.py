"""The per-chip peak on TPU targets: the figure the TPU compiler's own out-of-memory verdict
holds to (``benchmarks/tpu_peak_rule.py``), at most the HBM it compiled the program for, and
what ``show`` says where ``memory_analysis()`` reports a field as 0. Real ahead-of-time
compiles by libtpu (jax 0.10.2, libtpu 0.0.42.1), and the figures libtpu 0.0.50.1 gave for
MaxText's compiles of published configurations (``benchmarks/results/studies/published_maxtext.db``)."""

from __future__ import annotations

from typing import Any

import pytest

from remat_search import RematPlan, build_workload
from remat_search.measure.executables import Executables, measure
from remat_search.measure.measurement import Measurement, MemoryBreakdown, RawMeasurement, judge
from remat_search.report.text import describe_trial
from remat_search.report.results import TrialResult
from remat_search.spec.models import TimingConfig, TpuTarget
from remat_search.spec.workloads import NnxConfig, TransformerConfig
from remat_search.targets.base import target_of
from remat_search.units import parse_bytes

pytestmark = pytest.mark.slow  # compiles for TPU topologies

V5E = TpuTarget(platform="tpu", topology="v5e:2x2")
HBM_V5E = int(15.75 * 2**30)


def _measure(config: Any, policy: str, budget: int, mesh: dict[str, int] | None = None) -> Measurement:
    workload = build_workload(config)
    target = target_of(V5E)
    executables = Executables(workload, target=target, mesh=target.mesh(mesh))
    plan = RematPlan.uniform(policy, workload.layers)
    return measure(executables, plan, budget=budget, timing=TimingConfig(), gradient_tolerance=1e-3)


def test_a_program_the_compiler_fits_is_within_the_budget_though_its_breakdown_sum_is_over() -> None:
    """Near the HBM the compiler fits a program whose breakdown sum is over it (the sweep's
    transformer, no remat, 11,968 sequences: sum 17.4 GB, compiler peak 15.8 GB, HBM 16.9 GB):
    the peak is the compiler's, so the budget of a whole chip admits what the chip holds."""
    config = TransformerConfig(kind="transformer", layers=2, d_model=256, heads=4, d_ff=1024, seq_len=256,
                               batch=11968, vocab=512, attention="dense")
    m = _measure(config, "none", HBM_V5E)
    mem = m.memory
    assert mem is not None and m.oom_required_bytes is None  # the compiler's verdict: it fits
    assert mem.breakdown_sum > HBM_V5E >= mem.compiler_peak
    assert mem.peak == mem.compiler_peak and mem.peak_source == "compiler_peak" and mem.platform == "tpu"
    assert mem.hbm == HBM_V5E  # what the compiler compiled it for, kept beside its figures
    assert m.status == "measured"


@pytest.fixture(scope="module")
def decoder() -> dict[str, Measurement]:
    """The issue's NNX decoder (6 blocks, width 128, 4 heads, MLP 512, vocabulary 512, batch
    8 × 64 tokens) on v5e:2x2 as data 2 × fsdp 2, at a 30 MiB budget."""
    config = NnxConfig(kind="nnx", model="tests.models.nnx_decoder:Decoder", args={
        "vocab": 512, "d_model": 128, "heads": 4, "d_ff": 512, "layers": 6}, batch=8, seq_len=64, vocab=512)
    return {p: _measure(config, p, parse_bytes("30MiB"), {"data": 2, "fsdp": 2}) for p in ("none", "full")}


def test_full_remat_of_a_small_model_is_no_longer_rejected_where_no_remat_fits(decoder: dict[str, Measurement]) -> None:
    none, full = decoder["none"].memory, decoder["full"].memory
    assert none is not None and full is not None
    # The breakdown sums invert the two (full remat's temp counts 15 MB, no remat's reads 0) ...
    assert full.breakdown_sum > 30 * 2**20 > none.breakdown_sum
    # ... the compiler's peaks do not, and both fit.
    assert none.peak == none.compiler_peak < full.peak == full.compiler_peak < 1.2 * none.peak
    assert decoder["none"].status == decoder["full"].status == "measured"


def test_show_says_where_memory_analysis_reported_a_field_as_zero(decoder: dict[str, Measurement]) -> None:
    none, full = decoder["none"], decoder["full"]
    assert none.memory is not None
    if none.memory.temp != 0:  # libtpu 0.0.42 gave this program's temp as 0 (jax#12848); 0.0.50 states it
        none = none.model_copy(update={"memory": none.memory.model_copy(update={"temp": 0})})
    assert none.memory is not None and none.memory.temp == 0 and none.memory.unreported == ("temp",)
    assert full.memory is not None and full.memory.unreported == ()
    shown = describe_trial(TrialResult(number=0, status="measured", measurement=none))
    assert ("memory_analysis() gave temp_size_in_bytes as 0 or less (a known JAX issue on TPU, jax#12848): "
            "not what the step holds, so the peak is the compiler's peak") in shown
    assert "memory_analysis() gave" not in describe_trial(TrialResult(number=1, status="measured", measurement=full))


def _breakdown(**changes: Any) -> MemoryBreakdown:
    figures = {"argument": 100, "output": 100, "alias": 100, "temp": 50, "generated_code": 10}
    return MemoryBreakdown(**{**figures, **changes})


@pytest.mark.parametrize(
    ("platform", "compiler_peak", "peak", "source"),
    [("tpu", 120, 120, "compiler_peak"),  # below the breakdown sum (160): the compiler's all the same
     ("tpu", 200, 200, "compiler_peak"),
     ("tpu", 0, 160, "breakdown_sum"),  # unreported: the breakdown sum stands in
     ("tpu", -1, 160, "breakdown_sum"),
     ("gpu", 120, 160, "breakdown_sum"),  # elsewhere the larger, as before
     ("gpu", 200, 200, "compiler_peak"),
     (None, 120, 160, "breakdown_sum"),  # stored before the platform was kept: read as then
     ("cpu", None, 160, "breakdown_sum")],
)
def test_the_peak_rule_by_platform(platform: str | None, compiler_peak: int | None, peak: int, source: str) -> None:
    mem = _breakdown(platform=platform, compiler_peak=compiler_peak)
    assert (mem.peak, mem.peak_source) == (peak, source)


@pytest.mark.parametrize(("run", "figures", "host"), [
    # MaxText's compiles of published configurations (benchmarks/results/published_configs.md, "Memory"):
    ("v6e Llama 3.1 70B, 256 chips, its layer input and q, k, v offloaded", dict(
        argument=3324293120, output=3322988288, alias=3322982400, temp=25663098336, generated_code=97321984,
        host_temp=120795955200, compiler_peak=124120285952), True),
    ("v5e 32B, q, k, v offloaded", dict(argument=1529909248, output=1529751552, alias=1529745408, temp=15106487808,
                                        generated_code=36127744, host_temp=12884901888, compiler_peak=14414843392), True),
    ("v6e Llama 2 70B, q, k, v offloaded", dict(
        argument=3249221632, output=3249063680, alias=3249057792, temp=24503896896, generated_code=78272512,
        host_temp=13421772800, compiler_peak=20103269632), False),
])
def test_a_compiler_peak_that_is_the_hosts_gives_way_to_the_breakdown_sum(run: str, figures: dict[str, int], host: bool) -> None:
    """Where libtpu's peak is the arguments plus the host temporaries, the device's peak is
    not stated: the breakdown sum stands in, and show says why."""
    mem = MemoryBreakdown(**figures, platform="tpu")
    assert mem.compiler_peak_is_host is host
    assert (mem.peak, mem.peak_source) == ((mem.breakdown_sum, "breakdown_sum") if host else (mem.compiler_peak, "compiler_peak"))
    said = describe_trial(TrialResult(number=0, status="measured", measurement=Measurement(
        status="measured", plan_digest="p", memory=mem, time_source="estimated")))
    assert ("the compiler's peak is its arguments plus its host temporaries" in said) is host


def test_show_says_the_breakdown_sum_stands_in_for_an_unreported_compiler_peak() -> None:
    mem = _breakdown(platform="tpu", compiler_peak=-1, temp=-1)
    assert mem.unreported == ("temp", "peak") and mem.peak == mem.breakdown_sum
    m = Measurement(status="measured", plan_digest="p", memory=mem, time_source="estimated")
    assert ("memory_analysis() gave temp_size_in_bytes, peak_memory_in_bytes as 0 or less (a known JAX issue on TPU, "
            "jax#12848): not what the step holds, so the peak is the breakdown sum") in describe_trial(
        TrialResult(number=0, status="measured", measurement=m))


HBM_V6E = 32000 * 2**20
"""A v6e chip's HBM as libtpu states it (``targets.tpu.probe_hbm``): 31.25 GiB."""

MAXTEXT_FITTED = {
    # MaxText's compiles (libtpu 0.0.50.1) of published v6e configurations it trained: each offloads
    # its layer input and q, k, v (Llama 3.1 70B) or its decoder layer's tensors (Mistral 7B).
    "Llama 3.1 70B, v6e-32": dict(argument=13236826112, output=13236504320, alias=13236498432, temp=23465365888,
                                  generated_code=100789248, host_temp=48318382080, compiler_peak=61555240704),
    "Llama 3.1 70B, v6e-64": dict(argument=13244739584, output=13244417792, alias=13244411904, temp=20773032960,
                                  generated_code=98941952, host_temp=48318382080, compiler_peak=61563158272),
    "Mistral 7B, v6e-8": dict(argument=10866716672, output=10865411840, alias=10865405952, temp=23976013632,
                              generated_code=92226560, host_temp=45097156608, compiler_peak=55963904768),
    "Llama 3.1 70B, v6e-256": dict(argument=3324293120, output=3322988288, alias=3322982400, temp=25663098336,
                                   generated_code=97321984, host_temp=120795955200, compiler_peak=124120285952),
}


@pytest.mark.parametrize("run", sorted(MAXTEXT_FITTED))
def test_an_offloading_program_the_compiler_compiled_fits_the_chip_it_was_compiled_for(run: str) -> None:
    """The compiler's peak of each is the host's, and three of the breakdown sums read over the
    chip (34.3, 31.8 and 32.5 GiB of 31.25): the peak is at most the HBM the compiler compiled
    the program for, so ``budget: device`` admits what MaxText ran; a budget below the HBM does
    not (the device's own peak is not stated), and show says which rule gave the figure."""
    mem = MemoryBreakdown(**MAXTEXT_FITTED[run], platform="tpu", hbm=HBM_V6E)
    assert mem.compiler_peak_is_host
    over = mem.breakdown_sum > HBM_V6E
    assert over is (run != "Llama 3.1 70B, v6e-256")
    assert mem.peak == min(mem.breakdown_sum, HBM_V6E)
    assert mem.peak_source == ("compiler_verdict" if over else "breakdown_sum")
    raw = RawMeasurement(plan_digest="p", memory=mem, time_source="estimated", estimated_seconds=17.8)
    assert judge(raw, budget=HBM_V6E).status == "measured"
    assert judge(raw, budget=HBM_V6E - 2**30).status == ("over_budget" if over else "measured")
    said = describe_trial(TrialResult(number=0, status="measured", measurement=judge(raw, budget=HBM_V6E)))
    assert (f"peak 31.2 GiB per device, from the compiler verdict" in said) is over
    assert ("the TPU compiler compiled it for 31.2 GiB of HBM a chip, and it refuses a program that does not fit"
            in said) is over
    # Kept before the HBM was (schema 13): the breakdown sum, as then.
    assert MemoryBreakdown(**MAXTEXT_FITTED[run], platform="tpu").peak == mem.breakdown_sum


def test_the_hbm_caps_a_compiler_peak_over_it_and_only_on_tpu() -> None:
    """The compiler's verdict outranks any figure of a program it compiled (none has read over
    in ``benchmarks/tpu_peak_rule.py``, but the verdict is the compiler's own); off TPU no HBM is kept."""
    assert (_breakdown(platform="tpu", compiler_peak=200, hbm=180).peak, _breakdown(
        platform="tpu", compiler_peak=200, hbm=180).peak_source) == (180, "compiler_verdict")
    assert _breakdown(platform="tpu", compiler_peak=120, hbm=180).peak_source == "compiler_peak"
    assert _breakdown(platform="gpu", compiler_peak=200, hbm=180).peak == 200


def test_the_rule_on_an_offloading_sweep_to_the_compilers_flip() -> None:
    """``benchmarks/tpu_peak_rule.py``'s deep offloading transformer on v5e:2x2 (libtpu 0.0.50.1):
    at 5,652 sequences the compiler compiled it, its peak the host's (29.7 GB) and its breakdown
    sum 20.5 GB, both over the 16.9 GB it compiled for; at 5,720 it refused it. The study reads
    the first within the chip and the second over it, as the compiler did."""
    fitted = MemoryBreakdown(
        argument=42543104, output=39349248, alias=39348224, temp=20433768960, generated_code=15346176,
        host_temp=29632757760, compiler_peak=29675319296, platform="tpu", hbm=HBM_V5E)
    assert fitted.compiler_peak_is_host and fitted.breakdown_sum > HBM_V5E
    assert (fitted.peak, fitted.peak_source) == (HBM_V5E, "compiler_verdict")
    raw = RawMeasurement(plan_digest="fits", memory=fitted, time_source="estimated", estimated_seconds=1.0)
    assert judge(raw, budget=HBM_V5E).status == "measured"
    refused = RawMeasurement(plan_digest="refused", oom_required_bytes=16985928062, oom_temp_bytes=16943645982,
                             oom_available_bytes=16911433728)
    assert refused.peak_bytes is not None and refused.peak_bytes > HBM_V5E
    assert judge(refused, budget=HBM_V5E).status == "over_budget"
