"""The check of a plan's first step: the gradients it computed against the reference's, held to
a threshold made of the noise actually present.

What a remat plan must not change is the mathematics: the gradients of the loss (and the loss).
After one step from a fresh state the optimizer's first moment *is* the gradient, scaled
(optax's Adam family: ``mu = (1 − b1) · g``; SGD with momentum: ``trace = g``), so the check
reads it from the state the timed executable returns (:func:`gradient_carriers`), with no other
program compiled. It does not compare Adam's update: that is about ``± lr`` whatever a
gradient's size, so rounding that moves a tiny gradient across zero changes it by ``2 · lr``
(jax-ml/jax#8702: remat is not bitwise-neutral). Where the state holds no first moment (plain
SGD, a user's own optimizer) the change of the whole state is compared, and the check says so.

The figures are norm-relative, ``‖g − g_ref‖ / ‖g_ref‖``, per array and over all of them, in
float64 on the host. An array whose reference gradient is near zero is measured against a floor,
:data:`LEAF_FLOOR` of the norm an array of its size would have at the tree's mean square.

The threshold is measured, once per reference (:func:`noise_of`), from two more steps of the
reference's own executable:

- **rounding**: the reference on inputs whose floating arrays are each multiplied by
  ``1 ± PERTURBATION`` (random signs), its difference scaled by ``unit roundoff /
  PERTURBATION`` (the response is linear there: measured in docs/how-it-works.md). The unit
  roundoff is the program's matrix multiplications' (their operands' dtype at the precision the
  platform computes them: :func:`targets.platform.unit_roundoff`): what the gradients move by
  when each input moves by one rounding, as remat moves roundings.
- **rerun**: the reference run again on the same inputs: what a device that is not
  deterministic (a GPU's atomics) adds.

Where a carrier's change is read as ``after − before`` from a value that was not zero (a
parameter under plain SGD), the rounding figure also holds the storage rounding of its new value
(:attr:`FirstStep.storage`), which blurs a small change of a large value whatever the plan.

A check passes where each array's error, the whole tree's and the loss's are within
:data:`CHECK_FACTOR` times rounding + rerun, and the reference reproduces itself (its rerun
within :data:`CHECK_FACTOR` times its rounding): a model that draws other values on every run or
every recomputation (a host callback declared pure, a stateful generator) cannot be checked, and
fails every plan, loudly. ``gradient_tolerance`` in a spec replaces the measured threshold.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict

CHECK_FACTOR = 4.0
"""How many times the measured noise (rounding + rerun) a correct plan's error may reach: correct
plans reached at most 0.40 of the threshold it makes, in float32 and bfloat16, on one device,
four and a slice (``benchmarks/results/check_noise.md``)."""
PERTURBATION = 2.0**-4
"""The relative size of the rounding probe's nudge of each input: large enough that the
gradients' response to it stands clear of a model's own run-to-run noise, small enough that
the response is linear in it."""
LEAF_FLOOR = 1e-2
"""An array's error is relative to at least this share of the norm an array of its size would
have at the tree's mean square (a near-zero gradient is not divided by its own rounding)."""
MOMENTS = ("mu", "trace")
"""Names of an optimizer state's first moment, in order of preference: optax's Adam family
(adam, adamw, lion, MaxText's adamw) and its momentum ``trace``; after one step from zero each
is the gradient scaled."""
PROBE_SEED = 1
"""The seed of the rounding probe's random signs."""


@dataclass(frozen=True)
class Carriers:
    """Which leaves of the training state (indices into its flattened leaves) the check compares,
    their names, and what they are, in words."""

    indices: tuple[int, ...]
    names: tuple[str, ...]
    what: str


def gradient_carriers(state: Any) -> Carriers:
    """The leaves of ``state`` (a training state, or its shapes) that hold the first step's
    gradients: the optimizer's first moment where it has one (:data:`MOMENTS`), else every
    floating leaf (the state's whole change)."""
    import jax

    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    keys = [[_key_name(k) for k in path] for path, _ in flat]
    keys = [names[:-1] if names[-1:] == ["value"] else names for names in keys]  # an NNX variable's own `.value`
    for moment in MOMENTS:
        chosen = [i for i, names in enumerate(keys) if moment in names and _floating(flat[i][1])]
        if chosen:
            names = tuple("/".join(keys[i][keys[i].index(moment) + 1:]) or moment for i in chosen)
            return Carriers(tuple(chosen), names, f"the gradients, read from the optimizer's first moment ({moment!r})")
    chosen = [i for i, (_, leaf) in enumerate(flat) if _floating(leaf)]
    return Carriers(
        tuple(chosen), tuple("/".join(keys[i]) for i in chosen),
        "the whole training state's change (its optimizer keeps no first moment: the gradients cannot be read, "
        "and the threshold holds the rounding of storing the new state)",
    )


def _key_name(key: Any) -> str:
    for attr in ("name", "key", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _floating(leaf: Any) -> bool:
    import jax

    return jax.dtypes.issubdtype(leaf.dtype, np.floating)


@dataclass(frozen=True)
class FirstStep:
    """What a step did to fresh inputs, on the host: the change of each carrier leaf (see
    :class:`Carriers`; float64) and the loss."""

    gradients: tuple[np.ndarray, ...]
    loss: float
    storage: tuple[float, ...] = ()
    """Per carrier leaf, how far two correct steps' new values may be apart by their storage
    rounding alone: the norm of the spacing of its values in its own dtype over √6 (two roundings,
    each uniform over one spacing, of every element). A change read as ``after − before`` from a
    value that is not zero (a parameter under plain SGD) is blurred by it whatever the plan; zero
    where the leaf starts at zero (a first moment). Empty: not measured (a reference read back)."""


@dataclass(frozen=True)
class Errors:
    """Norm-relative differences of one first step from the reference's: per carrier leaf, over
    the whole tree, and of the loss."""

    leaves: tuple[float, ...]
    tree: float
    loss: float

    def scaled(self, factor: float) -> Errors:
        return Errors(tuple(e * factor for e in self.leaves), self.tree * factor, self.loss * factor)


def errors(step: FirstStep, reference: FirstStep) -> Errors:
    """How far ``step`` is from ``reference`` (see the module's docstring). NaN anywhere makes
    the figure NaN, which no threshold passes."""
    refs = [np.asarray(r, np.float64) for r in reference.gradients]
    diffs = [np.asarray(g, np.float64) - r for g, r in zip(step.gradients, refs, strict=True)]
    size = sum(r.size for r in refs) or 1
    total = math.sqrt(sum(float(np.sum(r * r)) for r in refs))
    leaves = []
    for d, r in zip(diffs, refs, strict=True):
        floor = LEAF_FLOOR * total * math.sqrt(r.size / size)
        leaves.append(_relative(float(np.linalg.norm(d)), max(float(np.linalg.norm(r)), floor)))
    tree = _relative(math.sqrt(sum(float(np.sum(d * d)) for d in diffs)), total)
    return Errors(tuple(leaves), tree, _relative(abs(step.loss - reference.loss), abs(reference.loss)))


def _relative(diff: float, scale: float) -> float:
    if math.isnan(diff) or math.isnan(scale):
        return math.nan
    return diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)


class Noise(BaseModel):
    """What a correct plan's first step may differ from the reference's by, measured on the
    reference (see the module's docstring): its rounding figures (per carrier leaf, tree, loss:
    the probe's difference scaled to :attr:`unit_roundoff`) and its rerun's."""

    model_config = ConfigDict(frozen=True)

    rounding: tuple[float, ...]
    """Per carrier leaf, then the tree, then the loss."""
    rerun: tuple[float, ...]
    unit_roundoff: float
    precision: str
    """The computation the unit roundoff is of, in words (``bfloat16 matmuls``)."""

    def as_errors(self) -> tuple[Errors, Errors]:
        return tuple(Errors(tuple(f[:-2]), f[-2], f[-1]) for f in (self.rounding, self.rerun))  # type: ignore[return-value]


def _storage(reference: FirstStep) -> Errors:
    """The storage rounding of ``reference``'s carriers (:attr:`FirstStep.storage`), relative
    as :func:`errors` makes its figures (zero where not measured)."""
    refs = [np.asarray(r, np.float64) for r in reference.gradients]
    stored = reference.storage or (0.0,) * len(refs)
    size = sum(r.size for r in refs) or 1
    total = math.sqrt(sum(float(np.sum(r * r)) for r in refs))
    leaves = tuple(_relative(s, max(float(np.linalg.norm(r)), LEAF_FLOOR * total * math.sqrt(r.size / size)))
                   for s, r in zip(stored, refs, strict=True))
    return Errors(leaves, _relative(math.sqrt(sum(s * s for s in stored)), total), 0.0)


def noise_of(reference: FirstStep, rerun: FirstStep, probe: FirstStep, *, unit_roundoff: float, precision: str) -> Noise:
    """The noise figures of a reference from its rerun and its rounding probe (see :class:`Noise`)."""
    scaled = errors(probe, reference).scaled(unit_roundoff / PERTURBATION)
    stored = _storage(reference)
    scaled = Errors(tuple(a + b for a, b in zip(scaled.leaves, stored.leaves, strict=True)),
                    scaled.tree + stored.tree, scaled.loss)
    again = errors(rerun, reference)
    return Noise(
        rounding=(*scaled.leaves, scaled.tree, scaled.loss), rerun=(*again.leaves, again.tree, again.loss),
        unit_roundoff=unit_roundoff, precision=precision,
    )


class GradientCheck(BaseModel):
    """One plan's first step against the reference's: the figures, the thresholds and what they
    were made of. :meth:`failure` gives the verdict, for the measured threshold or a spec's
    ``gradient_tolerance``."""

    model_config = ConfigDict(frozen=True, ser_json_inf_nan="strings")

    compared: str
    """What was compared, in words (:attr:`Carriers.what`)."""
    arrays: int
    leaf: str
    """The array closest to (or furthest past) its threshold."""
    leaf_error: float
    leaf_threshold: float
    max_error: float
    """The largest error of any array (what ``gradient_tolerance`` holds)."""
    tree_error: float
    tree_threshold: float
    loss_error: float
    loss_threshold: float
    rounding: float
    """The tree's rounding figure (see :class:`Noise`)…"""
    rerun: float
    """…its rerun figure…"""
    unit_roundoff: float
    precision: str
    factor: float = CHECK_FACTOR
    reproducible: bool
    """Whether the reference's rerun is within :attr:`factor` times its rounding."""

    def failure(self, tolerance: float | None = None) -> str | None:
        """Why the plan fails the check (None: it passes): against ``tolerance`` where given,
        else the measured thresholds."""
        if tolerance is not None:
            worst = max(self.max_error, self.tree_error, self.loss_error)
            return None if worst <= tolerance else (
                f"its first step's gradients differ from full remat's by {worst:.3g} (norm-relative; "
                f"worst array {self.leaf}) > gradient_tolerance {tolerance:g}"
            )
        if not self.reproducible:
            return (
                f"the reference is not reproducible: full remat run twice on the same inputs gives gradients "
                f"{self.rerun:.3g} apart, more than {self.factor:g} × the {self.rounding:.3g} that rounding of "
                f"{self.precision} explains: the model draws other values at each run or recomputation "
                f"(a host callback declared pure, a stateful random generator), so no plan can be checked"
            )
        for what, error, threshold in (
            (f"array {self.leaf}'s gradient differs", self.leaf_error, self.leaf_threshold),
            ("the gradients differ", self.tree_error, self.tree_threshold),
            ("the loss differs", self.loss_error, self.loss_threshold),
        ):
            if not error <= threshold:
                return (
                    f"{what} from full remat's by {error:.3g} "
                    f"(norm-relative) > threshold {threshold:.3g} = {self.factor:g} × the noise measured on full remat "
                    f"(rounding of {self.precision}, rerun): the plan computes other gradients than its model's"
                )
        return None

    def threshold_text(self, tolerance: float | None = None) -> str:
        """What the threshold was made of, in words (``show --trial``)."""
        if tolerance is not None:
            return f"gradient_tolerance {tolerance:g} (the spec's, in place of the measured threshold)"
        return (
            f"{self.factor:g} × (rounding {self.rounding:.2e}: the gradients' response to a rounding of "
            f"{self.precision}, unit roundoff {self.unit_roundoff:.2g}; + rerun {self.rerun:.2e}: full remat run twice)"
        )


def check(step: FirstStep, reference: FirstStep, noise: Noise, carriers: Carriers) -> GradientCheck:
    """``step`` against ``reference`` with ``noise``'s thresholds (see the module's docstring)."""
    seen = errors(step, reference)
    rounding, rerun = noise.as_errors()
    base = rounding.tree + rerun.tree
    thresholds = [CHECK_FACTOR * max(r + a, base) for r, a in zip(rounding.leaves, rerun.leaves, strict=True)]
    ratios = [e / t if t > 0 else (0.0 if e == 0 else math.inf) for e, t in zip(seen.leaves, thresholds, strict=True)]
    worst = max(range(len(ratios)), key=lambda i: (math.isnan(ratios[i]), ratios[i])) if ratios else None
    return GradientCheck(
        compared=carriers.what, arrays=len(carriers.indices),
        leaf=carriers.names[worst] if worst is not None else "",
        leaf_error=seen.leaves[worst] if worst is not None else 0.0,
        leaf_threshold=thresholds[worst] if worst is not None else 0.0,
        max_error=max(seen.leaves, key=lambda e: (math.isnan(e), e), default=0.0),
        tree_error=seen.tree, tree_threshold=CHECK_FACTOR * base,
        loss_error=seen.loss, loss_threshold=CHECK_FACTOR * max(rounding.loss + rerun.loss, base),
        rounding=rounding.tree, rerun=rerun.tree, unit_roundoff=noise.unit_roundoff, precision=noise.precision,
        reproducible=rerun.tree <= CHECK_FACTOR * rounding.tree,
    )


_DOT = re.compile(r"stablehlo\.(?:dot_general|dot|convolution)\b")
_PRECISION = re.compile(r"precision = \[(\w+)")
_OPERAND = re.compile(r":\s*\(tensor<([^>]*)>")


def matmul_precision(lowered_text: str, platform: str, fallback: str) -> tuple[float, str]:
    """The unit roundoff of a lowered program's matrix multiplications (the least precise of
    them) on ``platform``, and the computation it is of in words; ``fallback``'s (a dtype name)
    where the program has none."""
    from remat_search.targets.platform import unit_roundoff

    found: dict[tuple[str, str], float] = {}
    for line in lowered_text.splitlines():
        operand = _OPERAND.search(line) if _DOT.search(line) else None
        if operand is None:
            continue
        precision = _PRECISION.search(line)
        dtype, how = operand.group(1).split(",")[0].split("x")[-1].strip(), precision.group(1) if precision else "DEFAULT"
        found[(dtype, how)] = unit_roundoff(dtype, how, platform)
    if not found:
        return unit_roundoff(fallback, "DEFAULT", platform), f"{fallback} arrays"
    (dtype, how), u = max(found.items(), key=lambda item: item[1])
    named = {"f64": "float64", "f32": "float32", "f16": "float16", "bf16": "bfloat16"}.get(dtype, dtype)
    return u, f"{named} matmuls" + ("" if how == "DEFAULT" else f" at {how} precision")


@dataclass(frozen=True)
class Reference:
    """The reference's first step (full remat's, on fresh inputs) and the noise measured on it."""

    step: FirstStep
    noise: Noise


def first_step(executable: Any, inputs: tuple[Any, Any], carriers: Carriers) -> tuple[tuple[Any, Any], FirstStep]:
    """Run ``executable`` once on ``inputs`` (which it donates); the new ``(state, batch)``,
    still on the devices, and what the step did to ``carriers`` (on the host; on a slice
    gathered from every process, which all call this at once)."""
    import jax

    from remat_search.measure.placement import on_host

    state, batch = inputs
    before = jax.tree.leaves(state)
    before = on_host([before[i] for i in carriers.indices])
    state, loss = executable(state, batch)
    after = jax.tree.leaves(state)
    after = on_host([after[i] for i in carriers.indices])
    gradients = tuple(np.asarray(a, np.float64) - np.asarray(b, np.float64) for a, b in zip(after, before, strict=True))
    storage = tuple(float(np.linalg.norm(np.spacing(np.asarray(a)).astype(np.float64))) / math.sqrt(6) if np.any(b)
                    else 0.0 for a, b in zip(after, before, strict=True))
    return (state, batch), FirstStep(gradients=gradients, loss=float(on_host(loss)), storage=storage)


def nudged(inputs: tuple[Any, Any], *, size: float = PERTURBATION, seed: int = PROBE_SEED) -> tuple[Any, Any]:
    """``inputs`` with each floating array multiplied by ``1 ± size`` (random signs, from
    ``seed``, the same whatever the sharding), in its own dtype and shardings: the rounding
    probe's inputs. On a slice every process calls it at once.

    The signs are one draw over all the arrays' elements, cut into each array's shape: a key
    an array would compile a generator an array (a hundred for a small transformer's AdamW
    state), about 4 × the compile time of this one program."""
    import jax
    import jax.numpy as jnp

    leaves, treedef = jax.tree.flatten(inputs)
    floats = [i for i, a in enumerate(leaves) if _floating(a)]  # the others (keys, counts, tokens) stay as they are

    def nudge(arrays: list[Any]) -> list[Any]:
        signs = jax.random.rademacher(jax.random.key(seed), (sum(a.size for a in arrays),), jnp.float32)
        starts = np.cumsum([0, *(a.size for a in arrays)])
        return [(a.astype(jnp.float32) * (1 + size * signs[start:start + a.size].reshape(a.shape))).astype(a.dtype)
                for a, start in zip(arrays, starts[:-1], strict=True)]

    out = jax.jit(nudge, out_shardings=[leaves[i].sharding for i in floats], donate_argnums=0)([leaves[i] for i in floats])
    for i, a in zip(floats, out, strict=True):
        leaves[i] = a
    return jax.tree.unflatten(treedef, leaves)
