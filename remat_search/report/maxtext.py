"""The answer for a MaxText config: the best plan at a budget that MaxText can express.

MaxText gives every decoder layer one remat policy, named by its tensors
(``plans.export.maxtext``), so a study's best plan, a per-layer mix say, may have no MaxText
form. Then the answer is the fastest candidate of the study that fits the budget and has
one, by the study's own ranking (``results.rank``: step time, or time per token in a study of
configurations), with what it costs against the best: :class:`MaxTextAnswer`.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from remat_search.errors import NoFeasiblePlan, SpecError
from remat_search.plans.export import MaxTextValue, maxtext, maxtext_remat
from remat_search.plans.plan import RematPlan
from remat_search.report.results import TrialResult, rank
from remat_search.report.stored import StoredStudy
from remat_search.units import format_bytes


class MaxTextAnswer(BaseModel):
    """The candidate written as a MaxText config, and the study's best beside it."""

    model_config = ConfigDict(frozen=True)

    answer: TrialResult
    """The fastest candidate that fits and that MaxText can express."""
    best: TrialResult
    """The study's best at the budget (``best``'s answer): :attr:`answer` itself where MaxText can
    express it."""
    settings: dict[str, MaxTextValue]
    """:attr:`answer`'s MaxText settings (``plans.export.maxtext``)."""

    @property
    def is_best(self) -> bool:
        """Whether the answer is the study's best itself."""
        return self.answer.number == self.best.number

    @property
    def slower_percent(self) -> float:
        """How much slower the answer is than the best, in %: its step time over the best's
        (per token each device trains on, in a study of configurations), less one."""
        assert self.answer.cost is not None and self.best.cost is not None
        return (self.answer.cost / self.best.cost - 1) * 100

    @property
    def lower_throughput_percent(self) -> float | None:
        """How much lower the answer's throughput is than the best's, in %, where both carry a
        configuration (else None)."""
        if self.answer.throughput is None or self.best.throughput is None:
            return None
        return (1 - self.answer.throughput / self.best.throughput) * 100

    def notice(self) -> str | None:
        """One line saying that the answer is not the study's best, what that is and what the
        answer costs (None where it is the best)."""
        if self.is_best:
            return None
        assert self.best.plan is not None
        lower = self.lower_throughput_percent
        cost = (
            f"{lower:.1f}% lower throughput ({self.answer.throughput:.4g} vs {self.best.throughput:.4g} tokens/s per device)"
            if lower is not None else
            f"{self.slower_percent:.1f}% slower ({self.answer.seconds:.4g} s vs {self.best.seconds:.4g} s a step)"
        )
        return (
            f"note: the study's best is {self.best.summary()} (trial {self.best.number}), {_why_not(self.best.plan)}; "
            f"this is the fastest candidate MaxText can express, {self.answer.summary()} (trial {self.answer.number}): {cost}"
        )


def maxtext_answer(study: StoredStudy, budget: int) -> MaxTextAnswer:
    """The best plan of ``study`` within ``budget`` that MaxText can express, beside the
    study's best there (:meth:`StoredStudy.best`; its :class:`NoFeasiblePlan` where nothing
    fits). Where the best has no MaxText form, the study's timed plans that fit are read
    (:meth:`StoredStudy.report`) and the first of them by :func:`results.rank` that has one is
    the answer; where none has, :class:`NoFeasiblePlan` says so. A configuration MaxText has no
    name for (a mesh axis) is the :class:`SpecError` of ``plans.export.maxtext``."""
    best = study.best(budget)
    if _expressible(best.plan):
        return MaxTextAnswer(answer=best, best=best, settings=maxtext(best.plan))  # type: ignore[arg-type]
    fitting = [t for t in study.report().timed() if t.peak_bytes is not None and t.peak_bytes <= budget]
    answer = next((t for t in sorted(fitting, key=rank) if _expressible(t.plan)), None)
    if answer is None:
        assert best.plan is not None
        raise NoFeasiblePlan(
            f"--format maxtext: no timed plan of study {study.name!r} that fits {format_bytes(budget)} has a MaxText "
            f"form; its best there, {best.summary()} (trial {best.number}), {_why_not(best.plan)}; use json or yaml"
        )
    assert answer.plan is not None
    return MaxTextAnswer(answer=answer, best=best, settings=maxtext(answer.plan))


def _expressible(plan: RematPlan | None) -> bool:
    """Whether MaxText's remat settings can say ``plan`` (its configuration aside)."""
    if plan is None:
        return False
    try:
        maxtext_remat(plan)
    except SpecError:
        return False
    return True


def _why_not(plan: RematPlan) -> str:
    """Why MaxText cannot express ``plan``, in a few words."""
    if plan.layout != "flat":
        return f"a {plan.layout} plan, which MaxText cannot express (it checkpoints each layer alone)"
    if not plan.is_uniform:
        return "a per-layer mix, which MaxText cannot express (one remat_policy for every decoder layer)"
    return f"whose policy {plan.layers[0]} has no MaxText form"
