"""Video layout helpers of :class:`~eqxdiff.models.wan_vae.AutoencoderKLWan`: Wan 2.2's pixel (un)patchify and the
spatially tiled decode, on channels-last video ``[batch, frames, height, width, channels]``."""

from collections.abc import Callable

import jax
import jax.numpy as jnp

from .._typing import Array


def patchify(x: Array, patch: int | None) -> Array:
    """``p x p`` pixel patches folded into channels, channel ``c * p * p + dx * p + dy`` (diffusers' ``patchify``:
    ``(c, pw, ph)`` order); ``patch`` ``None`` or 1: unchanged."""
    if not patch or patch == 1:
        return x
    b, f, h, w, c = x.shape
    x = x.reshape(b, f, h // patch, patch, w // patch, patch, c).transpose(0, 1, 2, 4, 6, 5, 3)
    return x.reshape(b, f, h // patch, w // patch, c * patch * patch)


def unpatchify(x: Array, patch: int | None) -> Array:
    """The inverse of :func:`patchify`."""
    if not patch or patch == 1:
        return x
    b, f, h, w, cp = x.shape
    x = x.reshape(b, f, h, w, cp // (patch * patch), patch, patch).transpose(0, 1, 2, 6, 3, 5, 4)
    return x.reshape(b, f, h * patch, w * patch, cp // (patch * patch))


def _blend(a: Array, b: Array, extent: int, axis: int) -> Array:
    """diffusers' ``blend_v`` / ``blend_h``: the first ``extent`` rows of ``b`` faded in from the last of ``a``."""
    extent = min(a.shape[axis], b.shape[axis], extent)
    if extent <= 0:
        return b
    shape = [1] * b.ndim
    shape[axis] = extent
    w = (jnp.arange(extent, dtype=jnp.float32) / extent).reshape(shape)
    tail = jax.lax.slice_in_dim(a, a.shape[axis] - extent, a.shape[axis], axis=axis).astype(jnp.float32)
    head = (tail * (1 - w) + jax.lax.slice_in_dim(b, 0, extent, axis=axis).astype(jnp.float32) * w).astype(b.dtype)
    return jnp.concatenate([head, jax.lax.slice_in_dim(b, extent, b.shape[axis], axis=axis)], axis=axis)


def blend_tiles(fn: Callable[[Array], Array], z: Array, *, tile: tuple[int, int], stride: tuple[int, int],
                out_stride: tuple[int, int], blend: tuple[int, int], scale: int) -> Array:
    """diffusers' ``AutoencoderKLWan.tiled_decode`` before unpatchify: ``fn`` on latent tiles of ``tile`` (height,
    width) every ``stride``; each output tile blended into its upper and left neighbours over ``blend`` rows /
    columns (the blended tiles replace the raw ones, as diffusers' in-place blends do), cropped to ``out_stride``,
    joined and cropped to ``scale`` times the latent size. Tiles of one shape go through one ``lax.map``: one compile
    per shape, one tile's activations live at a time."""
    height, width = z.shape[2:4]
    starts = [(i, j) for i in range(0, height, stride[0]) for j in range(0, width, stride[1])]
    tiles = {s: z[:, :, s[0]:s[0] + tile[0], s[1]:s[1] + tile[1]] for s in starts}
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
                t = _blend(out[i - stride[0], j], t, blend[0], axis=2)
            if j > 0:
                t = _blend(out[i, j - stride[1]], t, blend[1], axis=3)
            out[i, j] = t
            row.append(t[:, :, :out_stride[0], :out_stride[1]])
        rows.append(jnp.concatenate(row, axis=3))
    return jnp.concatenate(rows, axis=2)[:, :, :height * scale, :width * scale]


__all__ = ["blend_tiles", "patchify", "unpatchify"]
