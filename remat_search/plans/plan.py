"""A remat plan: which activations each layer saves for the backward pass.

A :class:`RematPlan` is pure data — frozen, hashable, JSON-serialisable — so it can be
stored in a study, printed, compared and used as a cache key (each layer's
:class:`~remat_search.plans.policy.LayerPolicy` becomes a ``jax.checkpoint`` policy in
``policy.py``). This module applies a plan to a chain of layers: unrolled
(:func:`apply_layers`, flat or nested) or scanned, one ``lax.scan`` per run of equal policies
(:func:`scan_layers`). A training script applies one in two lines, in each framework: one layer
at a time with :meth:`RematPlan.wrap` (JAX), :meth:`RematPlan.remat_module` (linen) or
:meth:`RematPlan.wrap_nnx` (NNX), and a scanned stack with :func:`scan_layers`,
:func:`scan_linen` or :func:`scan_nnx` (Flax is imported only by those that use it).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from remat_search.errors import SpecError
from remat_search.plans.configuration import Configuration
from remat_search.plans.policy import LayerPolicy, checkpoint_policy

Layout = Literal["flat", "nested"]
F = TypeVar("F", bound=Callable[..., Any])
X = TypeVar("X")


class RematPlan(BaseModel):
    """One :class:`LayerPolicy` per layer of a workload, layer 0 first, and a layout.

    ``flat`` checkpoints each layer by its policy and nothing more. ``nested`` additionally
    wraps the chain in the recursive halving of the JAX guide's ``recursive_checkpoint``
    (the half applied first is fully rematerialised, recursively): memory logarithmic in
    depth for O(n log n) compute. Only unrolled chains (:func:`apply_layers`) can be nested.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    layers: tuple[LayerPolicy, ...] = Field(min_length=1)
    layout: Layout = "flat"
    configuration: Configuration | None = None
    """The batch, accumulation and mesh the plan runs at, where a study searches them (see
    :mod:`~remat_search.plans.configuration`); None: the spec's own."""

    @classmethod
    def uniform(cls, policy: LayerPolicy | str, layers: int) -> RematPlan:
        """The plan that gives every one of ``layers`` layers the same policy."""
        if isinstance(policy, str):
            policy = LayerPolicy(kind=policy)
        return cls(layers=(policy,) * layers)

    @classmethod
    def from_json(cls, text: str) -> RematPlan:
        """Load a plan written by :meth:`to_json` (or ``remat-search best --json``)."""
        try:
            return cls.model_validate_json(text)
        except ValueError as e:
            raise SpecError(f"plan: not a remat plan ({_first_error(e)})") from None

    def to_json(self) -> str:
        """Canonical JSON: the same plan always gives the same text.

        ``layout`` is written only when it is not ``flat``, and ``configuration`` only where
        there is one, so plans keep the text (and :attr:`digest`) they had before either existed.
        """
        unset = {"layout"} if self.layout == "flat" else set()
        data = self.model_dump(mode="json", exclude=unset | ({"configuration"} if self.configuration is None else set()))
        if self.configuration is not None and not self.configuration.settings:
            del data["configuration"]["settings"]
        return json.dumps(data, sort_keys=True, separators=(",", ":"))

    @property
    def digest(self) -> str:
        """A stable hash of the canonical JSON (16 hex digits), usable as a cache key."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    @property
    def is_uniform(self) -> bool:
        """One policy on every layer, as :meth:`uniform` builds (whatever the layout)."""
        return len(set(self.layers)) == 1

    @property
    def kind(self) -> Literal["keep", "recompute", "offload"]:
        """What it does with the layers' activations, as a calibration's error is kept by
        (``targets.calibration``): ``offload`` where a layer moves tensors to host memory,
        ``recompute`` where a layer is checkpointed, ``keep`` where none is (no remat)."""
        if any(p.host_memory for p in self.layers):
            return "offload"
        return "recompute" if any(p.checkpoints for p in self.layers) else "keep"

    @property
    def tensor_names(self) -> frozenset[str]:
        """Every tensor name any layer's policy refers to."""
        return frozenset(n for p in self.layers for n in p.tensor_names)

    def summary(self, labels: Iterable[str] | None = None) -> str:
        """A short human form, runs of equal layers collapsed: ``full×2 dots×6``.

        ``labels``, one per layer (the spec's choice labels), replace the policies' own text.
        Nested plans start with ``nested:`` (``nested: none×8``), and a plan with a
        configuration with it (``batch 4 · fsdp=4: full×8``).
        """
        text = collapse_runs(labels if labels is not None else (str(p) for p in self.layers))
        text = f"nested: {text}" if self.layout == "nested" else text
        return text if self.configuration is None else f"{self.configuration.summary()}: {text}"

    def check(self, *, layers: int, tensor_names: Iterable[str]) -> None:
        """Raise :class:`SpecError` unless the plan fits a workload of this shape."""
        if len(self.layers) != layers:
            raise SpecError(f"plan: has {len(self.layers)} layers, the workload has {layers}")
        unknown = sorted(self.tensor_names - set(tensor_names))
        if unknown:
            raise SpecError(
                f"plan: unknown tensor name(s) {unknown}; the workload names "
                f"{sorted(tensor_names)}"
            )

    def policy_for(self, layer: int) -> Callable[..., Any] | None:
        """The ``jax.checkpoint`` policy of ``layer``, or None when it is not checkpointed."""
        return checkpoint_policy(self.layers[layer])

    def wrap(self, fn: F, layer: int, *, prevent_cse: bool = True) -> F:
        """Return ``fn`` checkpointed with the policy of ``layer`` (``fn`` itself for ``none``)."""
        if not self.layers[layer].checkpoints:
            return fn
        import jax

        return jax.checkpoint(fn, policy=self.policy_for(layer), prevent_cse=prevent_cse)

    def remat_module(self, module_cls: type, layer: int, **remat_kwargs: Any) -> type:
        """Return a Flax linen module class wrapped with ``nn.remat`` for ``layer``
        (``module_cls`` itself for ``none``).

        The wrapped class keeps ``module_cls``'s name (``nn.remat`` calls it
        ``Checkpoint<Name>``), so an unnamed instance is named ``Block_0`` as before and the
        variables' tree is the same whatever the plan."""
        if not self.layers[layer].checkpoints:
            return module_cls
        import flax.linen as nn

        wrapped = nn.remat(module_cls, policy=self.policy_for(layer), **remat_kwargs)
        wrapped.__name__, wrapped.__qualname__ = module_cls.__name__, module_cls.__qualname__
        return wrapped

    def wrap_nnx(self, fn: F, layer: int, *, prevent_cse: bool = True) -> F:
        """Return ``fn`` wrapped with Flax NNX's ``nnx.remat`` and the policy of ``layer``
        (``fn`` itself for ``none``): :meth:`wrap` for functions that take NNX modules, whose
        state ``nnx.remat`` passes in and writes back. In a model's ``__call__``:
        ``x = plan.wrap_nnx(Block.__call__, i)(block, x)``."""
        if not self.layers[layer].checkpoints:
            return fn
        from flax import nnx

        return nnx.remat(fn, policy=self.policy_for(layer), prevent_cse=prevent_cse)


def segments(plan: RematPlan) -> list[tuple[int, int, LayerPolicy]]:
    """Runs of consecutive layers with equal policy: ``(start, end, policy)``, end exclusive.

    ``full full none dots dots`` → ``[(0, 2, full), (2, 3, none), (3, 5, dots)]``.
    """
    runs: list[tuple[int, int, LayerPolicy]] = []
    for i, policy in enumerate(plan.layers):
        if runs and runs[-1][2] == policy:
            runs[-1] = (runs[-1][0], i + 1, policy)
        else:
            runs.append((i, i + 1, policy))
    return runs


def apply_layers(plan: RematPlan, layer_fns: Sequence[Callable[[X], X]], x: X) -> X:
    """Apply ``layer_fns`` (one ``f_i(x) -> x`` per layer) in order, each checkpointed by its
    policy (:meth:`RematPlan.wrap`).

    For a ``nested`` plan the chain is also split in halves recursively, the half applied
    first wrapped in ``jax.checkpoint`` with no policy (full remat), as in the JAX guide's
    ``recursive_checkpoint``: O(log n) layer inputs live at once, for O(n log n) compute.
    """
    if len(layer_fns) != len(plan.layers):
        raise SpecError(f"plan: has {len(plan.layers)} layers, the workload applies {len(layer_fns)}")
    fns = [plan.wrap(fn, i) for i, fn in enumerate(layer_fns)]
    if plan.layout == "nested":
        return _recursive_checkpoint(fns)(x)
    for fn in fns:
        x = fn(x)
    return x


def _recursive_checkpoint(fns: Sequence[Callable[[X], X]]) -> Callable[[X], X]:
    """``fns`` composed (``fns[0]`` first), the first half of each split fully rematerialised."""
    import jax

    if len(fns) == 1:
        return fns[0]
    if len(fns) == 2:
        first, second = fns
        return lambda x: second(first(x))
    first = _recursive_checkpoint(fns[: len(fns) // 2])
    second = _recursive_checkpoint(fns[len(fns) // 2 :])
    checkpointed_first = jax.checkpoint(first)
    return lambda x: second(checkpointed_first(x))


def scan_layers(plan: RematPlan, body: Callable[[Any, X], X], stacked_params: Any, x: X) -> X:
    """Run a scanned model's layers: ``body(layer_params, x) -> x`` over ``stacked_params``,
    whose every leaf has a leading axis of length ``len(plan.layers)``.

    One ``jax.lax.scan`` per run of equal policies (:func:`segments`) over that run's slice of
    the parameters, its body wrapped in ``jax.checkpoint(body, policy=..., prevent_cse=False)``
    (unwrapped for ``none``). Nested plans cannot be scanned: :class:`SpecError`.
    """
    x, _ = _scan_runs(plan, lambda p, carry: (body(p, carry), None), stacked_params, x)
    return x


def scan_nnx(plan: RematPlan, blocks: Any, x: X) -> X:
    """Run a stacked Flax NNX block, ``blocks(x) -> x``, once per layer: as :func:`scan_layers`,
    one ``jax.lax.scan`` per run of equal policies, each layer's block merged from its slice of
    ``blocks``' state (every leaf with a leading axis of ``len(plan.layers)``: one ``Block`` made
    under ``nnx.vmap`` with ``nnx.split_rngs(splits=N)``, as README's NNX scanned script does).

    The stack's state stays one tree whatever the plan, so a checkpoint fits every plan; what a
    call changes in a layer's state (an RNG count, statistics) is written back to ``blocks``.
    """
    from flax import nnx

    graphdef, state = nnx.split(blocks)

    def body(layer_state: Any, carry: X) -> tuple[X, Any]:
        block = nnx.merge(graphdef, layer_state)
        return block(carry), nnx.state(block)

    x, new_state = _scan_runs(plan, body, state, x)
    nnx.update(blocks, new_state)
    return x


def scan_linen(plan: RematPlan, block_cls: type, *args: Any, name: str | None = None, **kwargs: Any) -> Any:
    """A Flax linen module that runs ``block_cls(*args, **kwargs)`` (called ``block(x) -> x``)
    once per layer of ``plan``: one ``nn.scan`` per run of equal policies, over
    ``nn.remat(block_cls, policy=..., prevent_cse=False)`` (plain ``block_cls`` for ``none``).

    One scan has one body and so one policy: a plan of several runs is several scans. Their
    variables are the submodules ``seg0``, ``seg1``, … of the returned module, each stacked over
    its run's length (every collection stacked, every RNG stream split per layer), so the
    variables' tree follows the plan's runs. Build it in ``setup`` or an ``@nn.compact`` method;
    ``name`` names the returned module, the other arguments go to ``block_cls``.
    """
    return _linen_scan_module()(plan=plan, block_cls=block_cls, args=tuple(args), kwargs=tuple(kwargs.items()), name=name)


def _scan_runs(plan: RematPlan, body: Callable[[Any, X], tuple[X, Any]], stacked: Any, x: X) -> tuple[X, Any]:
    """``body(layer_slice, x) -> (x, y)`` over ``stacked``, one checkpointed ``lax.scan`` per run
    of equal policies; the ``y`` s stacked over all layers, runs joined in order."""
    import jax
    import jax.numpy as jnp

    if plan.layout != "flat":
        raise SpecError(
            f"plan: layout {plan.layout!r} is not supported for scanned layers; "
            "use layout 'flat' or an unrolled model (scan: false)"
        )
    lengths = {leaf.shape[0] if leaf.ndim else None for leaf in jax.tree.leaves(stacked)}
    if lengths != {len(plan.layers)}:
        raise SpecError(
            f"plan: has {len(plan.layers)} layers, the stacked parameters have leading axes {sorted(lengths, key=str)}"
        )
    outputs = []
    for start, end, policy in segments(plan):
        step = body if not policy.checkpoints else jax.checkpoint(
            body, policy=checkpoint_policy(policy), prevent_cse=False
        )
        params = stacked if end - start == len(plan.layers) else jax.tree.map(
            lambda a, s=start, e=end: a[s:e], stacked
        )
        x, ys = jax.lax.scan(lambda carry, p, f=step: f(p, carry), x, params)
        outputs.append(ys)
    joined = outputs[0] if len(outputs) == 1 else jax.tree.map(lambda *ys: jnp.concatenate(ys), *outputs)
    return x, joined


@functools.cache
def _linen_scan_module() -> type:
    """The linen module :func:`scan_linen` returns (made on first use: flax is imported then)."""
    import flax.linen as nn

    class LinenScan(nn.Module):
        plan: RematPlan
        block_cls: type
        args: tuple = ()
        kwargs: tuple = ()

        @nn.compact
        def __call__(self, x: Any) -> Any:
            if self.plan.layout != "flat":
                raise SpecError(
                    f"plan: layout {self.plan.layout!r} is not supported for scanned layers; use layout 'flat'"
                )
            for j, (start, end, policy) in enumerate(segments(self.plan)):
                cls = self.block_cls if not policy.checkpoints else nn.remat(
                    self.block_cls, policy=checkpoint_policy(policy), prevent_cse=False
                )
                run = nn.scan(
                    lambda block, carry, _: (block(carry), None),
                    variable_axes={True: 0}, split_rngs={True: True}, length=end - start,
                )
                x, _ = run(cls(*self.args, name=f"seg{j}", **dict(self.kwargs)), x, None)
            return x

    return LinenScan


def collapse_runs(items: Iterable[str]) -> str:
    """``a a b a`` → ``a×2 b a``."""
    runs: list[list[Any]] = []
    for item in items:
        if runs and runs[-1][0] == item:
            runs[-1][1] += 1
        else:
            runs.append([item, 1])
    return " ".join(f"{item}×{n}" if n > 1 else item for item, n in runs)


def _first_error(e: Exception) -> str:
    errors = getattr(e, "errors", None)
    if callable(errors):
        first = errors()[0]
        where = ".".join(str(p) if str(p).isprintable() else repr(str(p)) for p in first["loc"])  # one line
        return f"{where}: {first['msg']}" if where else first["msg"]
    return str(e).splitlines()[0]
