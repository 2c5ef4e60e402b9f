"""Argument handling every family's ``__call__`` shares: prompts as lists, seeds as PRNG keys, sizes and given
arrays checked, each error naming the argument and the fix."""

import jax
import jax.numpy as jnp

from ._checks import InputError, InputTypeError

__all__ = ["as_list", "check_size", "given_array", "prompt_list", "resolve_key", "seed_key"]


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
    """The PRNG key of a call: ``key`` if given, else one from ``seed`` (default 0; any int, :func:`seed_key`)."""
    if key is not None and seed is not None:
        raise InputError("pass seed= or key=, not both")
    return seed_key(0 if seed is None else int(seed)) if key is None else key


def check_size(height: int, width: int, factor: int, why: str) -> None:
    """Both sizes positive multiples of ``factor`` (``why``: what downsamples by it)."""
    for name, v in (("height", height), ("width", width)):
        if v <= 0 or v % factor:
            raise InputError(f"{name}={v} must be a {'positive ' if v <= 0 else ''}multiple of {factor} ({why}); "
                             f"try {name}={max(factor, int(v) // factor * factor)}")


def given_array(value, shape: tuple[int, ...], name: str, layout: str):
    """A user's array as float32 of exactly ``shape`` (``layout`` names its axes in the error)."""
    arr = jnp.asarray(value, dtype=jnp.float32)
    if arr.shape != tuple(shape):
        raise InputError(f"{name} must have shape {tuple(shape)} = {layout}, got {arr.shape}")
    return arr
