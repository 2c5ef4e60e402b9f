"""Tiled decoding as diffusers' VAEs do it (``enable_tiling()``): a function run on overlapping tiles of a tensor's
spatial axes, each output tile blended into its upper and left neighbours and cropped, the tiles joined.

Written once for any layout: ``axes`` names the two tiled axes (height and width: ``(1, 2)`` for images
``[b, h, w, c]``, ``(2, 3)`` for video ``[b, t, h, w, c]``). Tiles of one shape go through one ``lax.map``: one
compile per tile shape, one tile's activations live at a time.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp

from .._typing import Array


def blend(a: Array, b: Array, extent: int, axis: int) -> Array:
    """diffusers' ``blend_v`` / ``blend_h``: the first ``extent`` rows of ``b`` along ``axis`` faded in from the last
    rows of ``a`` (``a * (1 - y / extent) + b * (y / extent)``), in float32."""
    extent = min(a.shape[axis], b.shape[axis], extent)
    if extent <= 0:
        return b
    shape = [1] * b.ndim
    shape[axis] = extent
    w = (jnp.arange(extent, dtype=jnp.float32) / extent).reshape(shape)
    tail = jax.lax.slice_in_dim(a, a.shape[axis] - extent, a.shape[axis], axis=axis).astype(jnp.float32)
    head = (tail * (1 - w) + jax.lax.slice_in_dim(b, 0, extent, axis=axis).astype(jnp.float32) * w).astype(b.dtype)
    return jnp.concatenate([head, jax.lax.slice_in_dim(b, extent, b.shape[axis], axis=axis)], axis=axis)


def blend_tiles(fn: Callable[[Array], Array], x: Array, *, axes: tuple[int, int], tile: tuple[int, int],
                stride: tuple[int, int], blend_extent: tuple[int, int], keep: tuple[int, int]) -> Array:
    """``fn`` on tiles of ``tile`` (input rows, columns along ``axes``) starting every ``stride``; each output tile
    blended over ``blend_extent`` output rows / columns into its upper and left neighbours (the blended tiles replace
    the raw ones, as diffusers' in-place blends do), cropped to its first ``keep`` rows / columns, all joined."""
    (ah, aw), (height, width) = axes, (x.shape[axes[0]], x.shape[axes[1]])
    starts = [(i, j) for i in range(0, height, stride[0]) for j in range(0, width, stride[1])]

    def cut(a, i, j, size_i, size_j):
        return jax.lax.slice_in_dim(jax.lax.slice_in_dim(a, i, min(i + size_i, a.shape[ah]), axis=ah), j,
                                    min(j + size_j, a.shape[aw]), axis=aw)

    tiles = {s: cut(x, *s, *tile) for s in starts}
    out = {}
    for shape in dict.fromkeys(t.shape for t in tiles.values()):
        group = [s for s in starts if tiles[s].shape == shape]
        results = jax.lax.map(fn, jnp.stack([tiles[s] for s in group]))
        out.update({s: results[n] for n, s in enumerate(group)})
    rows = []
    for i in range(0, height, stride[0]):
        row = []
        for j in range(0, width, stride[1]):
            t = out[i, j]
            if i > 0:
                t = blend(out[i - stride[0], j], t, blend_extent[0], axis=ah)
            if j > 0:
                t = blend(out[i, j - stride[1]], t, blend_extent[1], axis=aw)
            out[i, j] = t
            row.append(cut(t, 0, 0, *keep))
        rows.append(jnp.concatenate(row, axis=aw))
    return jnp.concatenate(rows, axis=ah)


__all__ = ["blend", "blend_tiles"]
