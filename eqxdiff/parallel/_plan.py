"""What a model needs at run time to be parallel and memory-frugal: a :class:`Plan` (mesh, rules, remat policy).

Models hold an optional static ``plan`` field (``None``: no constraints, no remat; exactly the plain model) that
:func:`with_plan` sets on every block; blocks call :func:`constrain` on their activations and
:func:`checkpoint_block` at block boundaries. Nothing here reads a global: the plan travels with the model.
"""

import dataclasses
import enum
from collections.abc import Sequence

import equinox as eqx
import jax
from jax.sharding import Mesh

from ._rules import DEFAULT_RULES, AxisRules, activation_sharding


class Remat(enum.Enum):
    """Rematerialisation policy applied at block boundaries (UNet down/mid/up blocks, CLIP layers)."""

    NONE = "none"  # save everything (fastest, most memory)
    FULL = "full"  # save only block inputs; recompute the block in the backward pass
    DOTS_NO_BATCH = "dots_no_batch"  # save matmuls without batch dims (weight-stationary ones)
    OFFLOAD_DOTS = "offload_dots"  # those matmuls offloaded to pinned host memory
    OFFLOAD_NAMED = "offload_named"  # the named checkpoints in Plan.remat_names offloaded to pinned host memory
    NAMED = "named"  # save only the named checkpoints in Plan.remat_names (e.g. "resnet", "transformer")


# Names the models tag with jax.ad_checkpoint.checkpoint_name, for Remat.NAMED / Remat.OFFLOAD_NAMED.
CHECKPOINT_NAMES = ("resnet", "transformer", "attention", "mlp", "clip_layer")


def remat_policy(remat: Remat, names: Sequence[str] = ()):
    """The ``jax.checkpoint`` policy of ``remat`` (``None`` for full remat)."""
    cp = jax.checkpoint_policies
    unknown = sorted(set(names) - set(CHECKPOINT_NAMES))
    if unknown:
        raise ValueError(f"remat_names {unknown} are not checkpoint names the models tag; use {CHECKPOINT_NAMES}")
    if remat in (Remat.NAMED, Remat.OFFLOAD_NAMED) and not names:
        raise ValueError(f"remat={remat.value!r} needs remat_names, some of {CHECKPOINT_NAMES}")
    if remat is Remat.FULL:
        return None
    if remat is Remat.DOTS_NO_BATCH:
        return cp.dots_with_no_batch_dims_saveable
    if remat is Remat.OFFLOAD_DOTS:
        return cp.offload_dot_with_no_batch_dims("device", "pinned_host")
    if remat is Remat.NAMED:
        return cp.save_only_these_names(*names)
    if remat is Remat.OFFLOAD_NAMED:
        return cp.save_and_offload_only_these_names(names_which_can_be_saved=[],
                                                    names_which_can_be_offloaded=list(names),
                                                    offload_src="device", offload_dst="pinned_host")
    raise ValueError(f"no policy for {remat}")


@dataclasses.dataclass(frozen=True)
class Plan:
    """How a model runs: on ``mesh`` with ``rules`` (activations get sharding constraints), rematerialised at
    block boundaries by ``remat``. Hashable; lives in the models' static ``plan`` fields."""

    mesh: Mesh | None = None
    rules: AxisRules = DEFAULT_RULES
    remat: Remat = Remat.NONE
    remat_names: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "remat", Remat(self.remat))
        object.__setattr__(self, "remat_names", tuple(self.remat_names))
        if self.remat is not Remat.NONE:
            remat_policy(self.remat, self.remat_names)  # raises on a bad combination now, not at trace time

    @property
    def context(self) -> int:
        return self.mesh.shape.get("context", 1) if self.mesh is not None else 1


def constrain(x, plan: Plan | None, logical: Sequence[str | None]):
    """``x`` constrained to the sharding its logical axes give under ``plan`` (unchanged without a mesh)."""
    if plan is None or plan.mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, activation_sharding(plan.mesh, logical, x.shape, plan.rules))


def checkpoint_block(block, plan: Plan | None):
    """``block`` (a module or function of arrays) wrapped in ``jax.checkpoint`` with the plan's remat policy.

    Returns ``block`` itself with no plan or ``Remat.NONE``. Non-array arguments must be hashable (they are
    closed over, not traced)."""
    if plan is None or plan.remat is Remat.NONE:
        return block
    policy = remat_policy(plan.remat, plan.remat_names)

    def wrapped(*args, **kwargs):
        dynamic, static = eqx.partition((block, args, kwargs), eqx.is_array)
        return _checkpointed(static, policy)(dynamic)

    return wrapped


def _checkpointed(static, policy):
    def run(dynamic):
        fn, a, kw = eqx.combine(dynamic, static)
        return fn(*a, **kw)

    return jax.checkpoint(run, policy=policy)


def _has_plan_field(m) -> bool:
    return isinstance(m, eqx.Module) and any(f.name == "plan" for f in dataclasses.fields(m))


def with_plan(model, plan: Plan | None):
    """``model`` with ``plan`` in every sub-module that has a ``plan`` field (``None`` removes it)."""
    from ..nn import replace_static

    def rebuild(m):
        if isinstance(m, (list, tuple)):
            return type(m)(rebuild(x) for x in m)
        if not isinstance(m, eqx.Module):
            return m
        changes = {f.name: rebuild(getattr(m, f.name)) for f in dataclasses.fields(m)
                   if not f.metadata.get("static", False)}
        if _has_plan_field(m):
            changes["plan"] = plan
        return replace_static(m, **changes)

    return rebuild(model)
