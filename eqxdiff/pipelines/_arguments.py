"""Argument handling every family's ``__call__`` shares: prompts as lists, seeds as PRNG keys, sizes and given
arrays checked, each error naming the argument and the fix."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ._checks import InputError, InputTypeError

__all__ = ["as_list", "check_size", "given_array", "prompt_list", "one_key", "resolve_key", "seed_key"]


def prompt_list(prompt, name: str = "prompt") -> list[str]:
    """``prompt`` (one string or a sequence of them) as a list."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, (list, tuple)) and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    raise InputTypeError(f"{name} must be a string or a list of strings, got {type(prompt).__name__}")


def as_list(value, n: int, name: str) -> list:
    """``value`` (one string, or one per prompt) as ``n`` entries."""
    values = [value] * n if isinstance(value, str) else list(value)
    if len(values) != n:
        raise InputError(f"{name} has {len(values)} entries but prompt has {n}; pass one, or one per prompt")
    return values


def seed_key(seed: int) -> jax.Array:
    """The PRNG key of any int ``seed``: ``jax.random.key(seed)`` for ``0 <= seed < 2**32``; any other int (negative,
    or too large for a 32-bit key) is folded in 32 bits at a time, so distinct seeds give distinct keys."""
    if 0 <= seed < 2**32:
        return jax.random.key(seed)
    rest = 2 * seed if seed >= 0 else -2 * seed - 1  # one non-negative int per seed
    key = jax.random.key(rest & 0xFFFFFFFF)
    while True:  # at least one fold: never the key of a seed in [0, 2**32)
        rest >>= 32
        key = jax.random.fold_in(key, rest & 0xFFFFFFFF)
        if rest < 2**32:
            return key


def resolve_key(seed: int | None, key) -> jax.Array:
    """The PRNG key of a call: ``key`` if given (:func:`one_key`), else one from ``seed`` (default 0; any int,
    :func:`seed_key`)."""
    if key is not None and seed is not None:
        raise InputError("pass seed= or key=, not both")
    return seed_key(0 if seed is None else int(seed)) if key is None else one_key(key)


@functools.cache
def _raw_key_shape() -> tuple[int, ...]:
    """The shape of the default PRNG implementation's raw key data ((2,) for threefry), traced once per process."""
    return jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).shape


def one_key(key) -> jax.Array:
    """``key`` as one typed PRNG key: a typed key (``jax.random.key``) of shape ``()``, or the raw uint32 key data
    of ``jax.random.PRNGKey`` (shape ``(2,)``; a JAX or NumPy array), wrapped as the typed key of that data (the same
    draws). A batch of keys (typed ``(n, ...)``, raw ``(n, 2)``) is refused: a call draws all its noise from one key."""
    raw_shape = _raw_key_shape()
    if isinstance(key, (bool, int, np.integer)):
        raise InputTypeError(f"key={int(key)} is an int; pass seed={int(key)}, or key=jax.random.key({int(key)})")
    if not hasattr(key, "dtype") or not hasattr(key, "shape"):
        raise InputTypeError(f"key must be a JAX PRNG key (jax.random.key(seed)), got {type(key).__name__}")
    typed = jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    shape = tuple(key.shape)
    if typed and shape == ():
        return key
    if not typed and shape == raw_shape and key.dtype == np.uint32:
        return jax.random.wrap_key_data(jnp.asarray(key))
    if typed or (shape[-1:] == raw_shape and key.dtype == np.uint32):
        batch = shape if typed else shape[:-1]
        raise InputError(f"key has shape {shape}: a batch of {'x'.join(map(str, batch))} keys, but a call draws all "
                         "its noise from one key; pass one (key=keys[0]), or call once per key")
    raise InputError(f"key of dtype {key.dtype} and shape {shape} is not a PRNG key: pass jax.random.key(seed) (or "
                     f"jax.random.PRNGKey(seed), uint32 {raw_shape}), or seed=")


def check_size(height: int, width: int, factor: int, why: str) -> None:
    """Both sizes positive multiples of ``factor`` (``why``: what downsamples by it)."""
    for name, v in (("height", height), ("width", width)):
        if v <= 0 or v % factor:
            raise InputError(f"{name}={v} must be a {'positive ' if v <= 0 else ''}multiple of {factor} ({why}); "
                             f"try {name}={max(factor, int(v) // factor * factor)}")


def host_array(x, dtype=None) -> np.ndarray:
    """A user's array (NumPy, JAX, or a torch tensor someone passed: as float32) as a NumPy array of ``dtype``
    (default: its own)."""
    if hasattr(x, "detach"):
        x = x.detach().float().cpu().numpy()
    return np.asarray(x, dtype)


def given_array(value, shape: tuple[int, ...], name: str, layout: str):
    """A user's array as float32 of exactly ``shape`` (``layout`` names its axes in the error)."""
    arr = jnp.asarray(value, dtype=jnp.float32)
    if arr.shape != tuple(shape):
        raise InputError(f"{name} must have shape {tuple(shape)} = {layout}, got {arr.shape}")
    return arr
