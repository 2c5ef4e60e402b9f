"""Fast random initialisation on the host.

Building a module eagerly compiles one small XLA program per weight shape, and building it inside one
``eqx.filter_jit`` compiles one large program; both take minutes on a small CPU. :func:`host_init` traces the
constructor abstractly (``eqx.filter_eval_shape``) and fills each layer's weights with NumPy, using the same
distributions as the layers' own constructors (PyTorch's defaults).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..nn import Conv2d, Embedding, GroupNorm, LayerNorm, Linear, build_abstract

_LAYERS = (Linear, Conv2d, GroupNorm, LayerNorm, Embedding)


def _fill(layer, rng: np.random.Generator):
    w = layer.weight
    if isinstance(layer, (GroupNorm, LayerNorm)):
        values = [np.ones(w.shape), None if layer.bias is None else np.zeros(layer.bias.shape)]
    elif isinstance(layer, Embedding):
        values = [rng.standard_normal(w.shape), None]
    else:
        fan_in = w.shape[1] if isinstance(layer, Linear) else int(np.prod(w.shape[:3]))
        bound = 1.0 / np.sqrt(fan_in)
        values = [rng.uniform(-bound, bound, w.shape),
                  None if layer.bias is None else rng.uniform(-bound, bound, layer.bias.shape)]
    if getattr(layer, "bias", None) is None:
        return eqx.tree_at(lambda m: m.weight, layer, jnp.asarray(values[0], w.dtype))
    return eqx.tree_at(lambda m: (m.weight, m.bias), layer,
                       (jnp.asarray(values[0], w.dtype), jnp.asarray(values[1], layer.bias.dtype)))


def host_init(cls, config, *, seed: int = 0, dtype=jnp.float32):
    """``cls(config, dtype=dtype, key=...)`` with weights drawn on the host from ``seed`` (seconds, not minutes)."""
    skeleton = build_abstract(cls, config, dtype=dtype, key=jax.random.key(0))
    rng = np.random.default_rng(seed)
    filled = jax.tree.map(lambda x: _fill(x, rng) if isinstance(x, _LAYERS) else x, skeleton,
                          is_leaf=lambda x: isinstance(x, _LAYERS))
    left = [x for x in jax.tree.leaves(filled) if isinstance(x, jax.ShapeDtypeStruct)]
    if left:
        raise TypeError(f"host_init({cls.__name__}): {len(left)} weights outside the known layers "
                        f"({[type(t).__name__ for t in _LAYERS]}), e.g. {left[0]}; build it with eqx.filter_jit")
    return filled
