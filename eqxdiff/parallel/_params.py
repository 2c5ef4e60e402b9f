"""Parameters on a mesh: each leaf's ``NamedSharding`` from the logical axes its layer declares and the rules."""

from collections.abc import Sequence

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..core import DEFAULT_RULES, AxisRules, LeafSpec, leaf_specs, logical_to_spec


def param_spec(axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh, rules: AxisRules = DEFAULT_RULES,
               what: str = "parameter") -> P:
    """The ``PartitionSpec`` of a parameter with logical ``axes`` (as its layer declares them) and ``shape``."""
    return logical_to_spec(axes, shape, mesh, rules, "params", what=what)


def _axes(spec: LeafSpec) -> tuple[str | None, ...]:
    if spec.axes is None:
        raise TypeError(f"parameter {spec.name!r} has no declared logical axes: the module holding it must declare "
                        "them (PARAM_AXES or param_axes(); see eqxdiff.core.leaf_specs)")
    return spec.axes


def sharding_fn(mesh: Mesh, rules: AxisRules = DEFAULT_RULES):
    """``fn(spec, shape) -> NamedSharding`` for ``eqxdiff.load(..., sharding=fn)``: each device reads only its
    slice of every tensor, so a checkpoint loads straight onto an FSDP mesh."""

    def fn(spec: LeafSpec, shape: tuple[int, ...]) -> NamedSharding:
        return NamedSharding(mesh, param_spec(_axes(spec), shape, mesh, rules, what=spec.name))

    return fn


def param_shardings(model, mesh: Mesh, rules: AxisRules = DEFAULT_RULES):
    """A pytree like ``model`` (arrays or ``ShapeDtypeStruct`` s) holding each parameter's ``NamedSharding``."""
    leaves, specs, treedef = leaf_specs(model)
    fn = sharding_fn(mesh, rules)
    return jax.tree_util.tree_unflatten(treedef, [fn(s, tuple(x.shape)) for x, s in zip(leaves, specs)])


def shard_params(model, mesh: Mesh, rules: AxisRules = DEFAULT_RULES):
    """``model`` with every parameter placed on its rule-given ``NamedSharding``. ``ShapeDtypeStruct`` leaves
    get the sharding attached instead (abstract models, for compiling without weights)."""
    leaves, specs, treedef = leaf_specs(model)
    fn = sharding_fn(mesh, rules)
    out = []
    for x, s in zip(leaves, specs):
        target = fn(s, tuple(x.shape))
        if isinstance(x, jax.ShapeDtypeStruct):
            out.append(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=target))
        else:
            out.append(jax.device_put(x, target))
    return jax.tree_util.tree_unflatten(treedef, out)
