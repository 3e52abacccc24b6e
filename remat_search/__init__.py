"""remat-search: find the fastest gradient-checkpointing plan that fits a memory budget.

The public API::

    spec = remat_search.load_spec("search_spaces/demo.yaml")
    report = remat_search.run(spec)                       # search (resumes if interrupted)
    member = remat_search.member_of("host0:8476", 4, i)    # on a slice: process 0 runs(spec, member=member),
    remat_search.follow(spec, member)                     # the others follow it (docs/slice.md)
    remat_search.submit(spec)                             # or store it for workers: remat_search.work(url)
    front = remat_search.pareto_front("demo-transformer-cpu")
    best = remat_search.best_plan("demo-transformer-cpu", "200MiB")
    cal = remat_search.calibrate(remat_search.load_samples(path), name="h100", compiler="jax 0.11")  # remat-search calibrate
    advice = remat_search.plan_for_budget("demo-transformer-cpu", 200 * 2**20)  # predicted
    step = workload.step(best.plan)                       # or best.plan.wrap(fn, layer)
    model = remat_search.apply_nnx(model, best.plan)      # a Flax NNX model's blocks, in place
    apply = remat_search.apply_linen(model, best.plan, blocks="layers")  # a linen model's apply, planned
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from remat_search.errors import (
        CandidateRefused,
        NoFeasiblePlan,
        RematSearchError,
        RunError,
        SliceLost,
        SpecError,
        StorageError,
        WorkloadError,
    )
    from remat_search.measure.check import GradientCheck
    from remat_search.measure.measurement import Measurement, MemoryBreakdown
    from remat_search.measure.slice import SliceMember, member_of
    from remat_search.plans.plan import RematPlan, apply_layers, scan_layers, scan_linen, scan_nnx
    from remat_search.plans.policy import (
        POLICIES,
        LayerPolicy,
        PolicyKind,
        checkpoint_policy,
        register_policy,
    )
    from remat_search.report.queries import best_plan, list_studies, load_report, pareto_front
    from remat_search.report.results import StudyReport, TrialResult
    from remat_search.search.advice import Advice, plan_for_budget
    from remat_search.search.confirm import Comparison, compare_times, confirm_study
    from remat_search.search.cost_model import CostModel, fit_cost_model
    from remat_search.search.loop import run
    from remat_search.search.slice import follow
    from remat_search.search.solver import solve_front
    from remat_search.search.submission import Submitted, submit
    from remat_search.service.worker import work
    from remat_search.spec.loading import load_spec
    from remat_search.spec.maxtext_study import maxtext_study
    from remat_search.spec.models import SearchSpec
    from remat_search.targets.calibration import Calibration, Sample, calibrate, load_calibration, load_samples
    from remat_search.targets.platform import compiler_options
    from remat_search.targets.step_time import Efficiencies, StepEstimate
    from remat_search.units import parse_bytes
    from remat_search.workloads.base import Workload, build_workload
    from remat_search.workloads.linen import apply_linen
    from remat_search.workloads.nnx import apply_nnx

_API: dict[str, str] = {
    **dict.fromkeys(('Comparison', 'compare_times', 'confirm_study'), "remat_search.search.confirm"),
    **dict.fromkeys(('CandidateRefused', 'NoFeasiblePlan', 'RematSearchError', 'RunError', 'SliceLost', 'SpecError', 'StorageError', 'WorkloadError'), "remat_search.errors"),
    **dict.fromkeys(('SliceMember', 'member_of'), "remat_search.measure.slice"),
    **dict.fromkeys(('follow',), "remat_search.search.slice"),
    **dict.fromkeys(('compiler_options',), "remat_search.targets.platform"),
    **dict.fromkeys(('Calibration', 'Sample', 'calibrate', 'load_calibration', 'load_samples'), "remat_search.targets.calibration"),
    **dict.fromkeys(('Efficiencies', 'StepEstimate'), "remat_search.targets.step_time"),
    **dict.fromkeys(('Measurement', 'MemoryBreakdown'), "remat_search.measure.measurement"),
    **dict.fromkeys(('GradientCheck',), "remat_search.measure.check"),
    **dict.fromkeys(('RematPlan', 'apply_layers', 'scan_layers', 'scan_linen', 'scan_nnx'), "remat_search.plans.plan"),
    **dict.fromkeys(('Advice', 'plan_for_budget'), "remat_search.search.advice"),
    **dict.fromkeys(('CostModel', 'fit_cost_model'), "remat_search.search.cost_model"),
    **dict.fromkeys(('solve_front',), "remat_search.search.solver"),
    **dict.fromkeys(('POLICIES', 'LayerPolicy', 'PolicyKind', 'checkpoint_policy', 'register_policy'), "remat_search.plans.policy"),
    **dict.fromkeys(('best_plan', 'list_studies', 'load_report', 'pareto_front'), "remat_search.report.queries"),
    **dict.fromkeys(('StudyReport', 'TrialResult'), "remat_search.report.results"),
    **dict.fromkeys(('run',), "remat_search.search.loop"),
    **dict.fromkeys(('load_spec',), "remat_search.spec.loading"),
    **dict.fromkeys(('maxtext_study',), "remat_search.spec.maxtext_study"),
    **dict.fromkeys(('SearchSpec',), "remat_search.spec.models"),
    **dict.fromkeys(('Submitted', 'submit'), "remat_search.search.submission"),
    **dict.fromkeys(('parse_bytes',), "remat_search.units"),
    **dict.fromkeys(('work',), "remat_search.service.worker"),
    **dict.fromkeys(('Workload', 'build_workload'), "remat_search.workloads.base"),
    **dict.fromkeys(('apply_nnx',), "remat_search.workloads.nnx"),
    **dict.fromkeys(('apply_linen',), "remat_search.workloads.linen"),
}
"""Each public name and the module that defines it."""


__all__ = [
    "POLICIES",
    "Advice",
    "Calibration",
    "CandidateRefused",
    "Comparison",
    "CostModel",
    "Efficiencies",
    "GradientCheck",
    "LayerPolicy",
    "Measurement",
    "MemoryBreakdown",
    "NoFeasiblePlan",
    "PolicyKind",
    "RematPlan",
    "RematSearchError",
    "RunError",
    "Sample",
    "SearchSpec",
    "SliceLost",
    "SliceMember",
    "SpecError",
    "StepEstimate",
    "StorageError",
    "StudyReport",
    "Submitted",
    "TrialResult",
    "Workload",
    "WorkloadError",
    "apply_layers",
    "apply_linen",
    "apply_nnx",
    "best_plan",
    "build_workload",
    "calibrate",
    "checkpoint_policy",
    "compare_times",
    "compiler_options",
    "confirm_study",
    "fit_cost_model",
    "follow",
    "list_studies",
    "load_calibration",
    "load_report",
    "load_samples",
    "load_spec",
    "maxtext_study",
    "member_of",
    "pareto_front",
    "parse_bytes",
    "plan_for_budget",
    "register_policy",
    "run",
    "scan_layers",
    "scan_linen",
    "scan_nnx",
    "solve_front",
    "submit",
    "work",
]


def __getattr__(name: str) -> Any:
    """Import a public name's module when the name is first used: ``remat-search --help`` and
    the query commands then load only what they need (no JAX, no planner), which keeps each
    under a second."""
    if name not in _API:
        raise AttributeError(f"module 'remat_search' has no attribute {name!r}")
    value = getattr(importlib.import_module(_API[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
