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
from ._tree import has_field, map_modules, module_classes, replace_static


class Remat(enum.Enum):
    """Rematerialisation policy applied at block boundaries (UNet down/mid/up blocks, transformer layers)."""

    NONE = "none"  # save everything (fastest, most memory)
    FULL = "full"  # save only block inputs; recompute the block in the backward pass
    DOTS_NO_BATCH = "dots_no_batch"  # save matmuls without batch dims (weight-stationary ones)
    OFFLOAD_DOTS = "offload_dots"  # those matmuls offloaded to pinned host memory
    OFFLOAD_NAMED = "offload_named"  # the named checkpoints in Plan.remat_names offloaded to pinned host memory
    NAMED = "named"  # save only the named checkpoints in Plan.remat_names (e.g. "resnet", "transformer")


def checkpoint_names(model) -> tuple[str, ...]:
    """The names ``model``'s blocks tag with ``jax.ad_checkpoint.checkpoint_name``: every module class in it
    declares the names it tags in ``CHECKPOINT_NAMES``."""
    names: dict[str, None] = {}
    for cls in module_classes(model):
        names.update(dict.fromkeys(getattr(cls, "CHECKPOINT_NAMES", ())))
    return tuple(names)


def remat_policy(remat: Remat, names: Sequence[str] = ()):
    """The ``jax.checkpoint`` policy of ``remat`` (``None`` for full remat)."""
    cp = jax.checkpoint_policies
    if remat in (Remat.NAMED, Remat.OFFLOAD_NAMED) and not names:
        raise ValueError(f"remat={remat.value!r} needs remat_names: the checkpoint names to keep (the models "
                         "declare theirs; eqxdiff.parallel.checkpoint_names(model) lists them)")
    if names and remat not in (Remat.NAMED, Remat.OFFLOAD_NAMED):
        raise ValueError(f"remat_names={tuple(names)} are kept by remat 'named' / 'offload_named', but remat="
                         f"{remat.value!r} keeps none: use remat='named' (or 'offload_named') with them, or drop them")
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
        if self.remat is not Remat.NONE or self.remat_names:
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


def with_plan(model, plan: Plan | None):
    """``model`` with ``plan`` in every sub-module that has a ``plan`` field (``None`` removes it).

    A plan that keeps named checkpoints (``Remat.NAMED`` / ``OFFLOAD_NAMED``) must name only checkpoints the
    model declares (:func:`checkpoint_names`); any other name raises ``ValueError`` listing the model's."""
    if plan is not None and plan.remat in (Remat.NAMED, Remat.OFFLOAD_NAMED):
        declared = checkpoint_names(model)
        unknown = [n for n in plan.remat_names if n not in declared]
        if unknown:
            raise ValueError(f"remat_names {unknown} are not checkpoint names {type(model).__name__} tags; it "
                             f"tags {list(declared)}")
    return map_modules(lambda m: replace_static(m, plan=plan) if has_field(m, "plan") else m, model)
