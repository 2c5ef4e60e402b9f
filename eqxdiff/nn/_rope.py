"""Rotary position embeddings: tables built once per shape in NumPy, applied to queries and keys in float32.

Positions are static (they follow from the latent grid's shape), so the cosine/sine tables are NumPy constants,
never traced. Every family rotates **adjacent pairs** ``(x[2i], x[2i+1])`` by the angle of frequency ``i``; the
tables hold each angle twice (``cos[2i] == cos[2i+1]``). They differ in how angles are laid out:

- Flux (:func:`flux_rope`): per position axis ``a`` (ids ``[seq, 3]``), ``axes_dim[a]`` channels of
  ``pos * theta ** (-2j / axes_dim[a])``, the axes concatenated: diffusers' ``FluxPosEmbed``, float64.
- Wan (:func:`wan_rope`): the same with the patch grid's frame/row/column indices; rows and columns get
  ``2 * (head_dim // 6)`` channels each, frames the rest: diffusers' ``WanRotaryPosEmbed``, float64.
- LTX-Video (:func:`ltx_rope`): one table over the whole inner dimension (applied before the head split),
  frequencies ``theta ** linspace(0, 1, dim // 6) * pi / 2`` times ``2 * pos - 1`` of normalised coordinates,
  interleaved (frequency-major, then axis), padded **in front** with ``cos = 1, sin = 0`` when ``dim % 6 != 0``:
  diffusers' ``LTXVideoRotaryPosEmbed``. The reference computes these angles in float32 (the model was trained
  with them); reproducing that rounding matters (``pi / 2 * 10000`` rounds by ~1e-3 in float32), so the angles
  are formed with the same float32 operations and only the cosine and sine are taken in float64.
"""

import math
from collections.abc import Sequence
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from .._typing import Array, Float, typechecked


class Rope(NamedTuple):
    """Cosine and sine tables ``[..., seq, rot_dim]`` (``rot_dim`` = head_dim, or heads * head_dim for a table over
    the whole inner dimension as LTX's), NumPy or JAX float32; a pytree, so it passes through ``jit``."""

    cos: np.ndarray | Array
    sin: np.ndarray | Array

    def as_arrays(self) -> "Rope":
        """The tables as float32 JAX arrays. Under ``jit`` a model converts its NumPy tables once with this, so the
        program holds one constant per table, not one per layer that applies them (a 40-block Wan 14B at 720p
        captured 6 GB of copies of its 39 MB tables before)."""
        return Rope(jnp.asarray(self.cos, jnp.float32), jnp.asarray(self.sin, jnp.float32))


def _interleave(angles: np.ndarray) -> Rope:
    """cos/sin of ``angles [..., n]`` (float64 maths), each repeated twice along the last axis, as float32."""
    cos = np.repeat(np.cos(np.asarray(angles, np.float64)), 2, axis=-1)
    sin = np.repeat(np.sin(np.asarray(angles, np.float64)), 2, axis=-1)
    return Rope(cos.astype(np.float32), sin.astype(np.float32))


def rope_angles(dim: int, positions, theta: float = 10000.0) -> np.ndarray:
    """``[len(positions), dim // 2]`` angles ``pos * theta ** (-2j / dim)`` in float64: diffusers'
    ``get_1d_rotary_pos_embed(dim, pos, theta, freqs_dtype=torch.float64)`` before its cos/sin."""
    if dim % 2:
        raise ValueError(f"rotary embedding: dim={dim} must be even (channels are rotated in pairs)")
    freqs = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    return np.outer(np.asarray(positions, np.float64), freqs)


def flux_rope(ids, axes_dim: Sequence[int], theta: float = 10000.0) -> Rope:
    """Flux's tables ``[seq, sum(axes_dim)]`` for position ``ids [seq, len(axes_dim)]`` (text tokens ``(0, 0, 0)``,
    image token ``(0, row, col)`` on the packed grid); ``sum(axes_dim)`` must be the head dim."""
    ids = np.asarray(ids)
    if ids.ndim != 2 or ids.shape[1] != len(axes_dim):
        raise ValueError(f"flux_rope: ids of shape {ids.shape}; expected [seq, {len(axes_dim)}], one column per "
                         f"entry of axes_dim={tuple(axes_dim)}")
    pos = ids.astype(np.float32)  # diffusers: ids.float(), then float64 frequencies
    return _interleave(np.concatenate([rope_angles(d, pos[:, i], theta) for i, d in enumerate(axes_dim)], -1))


def wan_rope(head_dim: int, grid: tuple[int, int, int], theta: float = 10000.0) -> Rope:
    """Wan's tables ``[frames * height * width, head_dim]`` for a patch grid of ``(frames, height, width)`` patches,
    tokens in (frame, row, column) order."""
    hw = 2 * (head_dim // 6)
    dims = (head_dim - 2 * hw, hw, hw)
    axes = [rope_angles(d, np.arange(n), theta) for d, n in zip(dims, grid)]
    f, h, w = grid
    angles = np.concatenate([
        np.broadcast_to(axes[0][:, None, None], (f, h, w, axes[0].shape[-1])),
        np.broadcast_to(axes[1][None, :, None], (f, h, w, axes[1].shape[-1])),
        np.broadcast_to(axes[2][None, None, :], (f, h, w, axes[2].shape[-1])),
    ], axis=-1)
    return _interleave(angles.reshape(f * h * w, -1))


def _linspace_f32(n: int) -> np.ndarray:
    """``torch.linspace(0, 1, n, dtype=float32)`` as its scalar kernel computes it: ``i * step`` up to half way,
    ``1 - (n - 1 - i) * step`` after, in float32. (PyTorch's vectorised CPU kernel differs by an ulp in some entries
    when ``n > 8``.)"""
    if n == 1:
        return np.zeros(1, np.float32)
    step = np.float32(1.0) / np.float32(n - 1)
    i = np.arange(n)
    low = step * i.astype(np.float32)
    high = np.float32(1.0) - step * (n - 1 - i).astype(np.float32)
    return np.where(i < n // 2, low, high).astype(np.float32)


def ltx_rope_frequencies(dim: int, theta: float = 10000.0) -> np.ndarray:
    """LTX's ``dim // 6`` float32 frequencies ``theta ** linspace(0, 1, dim // 6) * pi / 2``, rounded as PyTorch's
    float32 operations round them, the power correctly rounded. (PyTorch's float32 power and vectorised linspace are
    not always correctly rounded: at dim 2048 about 9% of its frequencies differ from these by a few ulps.)"""
    freqs = (np.float64(theta) ** _linspace_f32(dim // 6).astype(np.float64)).astype(np.float32)
    return freqs * np.float32(math.pi) / np.float32(2.0)


def ltx_rope(dim: int, *, grid: tuple[int, int, int] | None = None,
             interpolation_scale: tuple[float, float, float] | None = None, coords=None,
             patch_size: int = 1, patch_size_t: int = 1, base: tuple[int, int, int] = (20, 2048, 2048),
             theta: float = 10000.0) -> Rope:
    """LTX-Video's tables ``[batch, seq, dim]`` (``dim`` = heads * head_dim; batch 1 unless ``coords`` has more).

    Positions are either the latent ``grid`` ``(frames, height, width)`` (tokens in (frame, row, column) order)
    scaled by ``interpolation_scale`` (the pipeline's ``rope_interpolation_scale``: ``(vae_temporal / frame_rate,
    vae_spatial, vae_spatial)``; without it the raw indices are used, as diffusers does) times the patch size over
    ``base``; or explicit ``coords [batch, 3, seq]`` (``video_coords``), divided by ``base``."""
    if (grid is None) == (coords is None):
        raise ValueError("ltx_rope: give either grid=(frames, height, width) or coords=[batch, 3, seq], not both")
    base32 = np.asarray(base, np.float32)
    if coords is None:
        f, h, w = grid
        mesh = np.meshgrid(np.arange(f, dtype=np.float32), np.arange(h, dtype=np.float32),
                           np.arange(w, dtype=np.float32), indexing="ij")
        pos = np.stack([m.reshape(-1) for m in mesh], axis=-1)[None]  # [1, seq, 3]
        if interpolation_scale is not None:
            patch = np.asarray([patch_size_t, patch_size, patch_size], np.float32)
            pos = pos * np.asarray(interpolation_scale, np.float32) * patch / base32
    else:
        coords = np.asarray(coords, np.float32)
        if coords.ndim != 3 or coords.shape[1] != 3:
            raise ValueError(f"ltx_rope: coords of shape {coords.shape}; expected [batch, 3, seq]")
        pos = np.swapaxes(coords, 1, 2) / base32
    pos = pos.astype(np.float32)
    freqs = ltx_rope_frequencies(dim, theta)
    angles = freqs * (pos[..., None] * np.float32(2.0) - np.float32(1.0))  # [batch, seq, 3, dim // 6], float32
    table = _interleave(np.swapaxes(angles, -1, -2).reshape(*angles.shape[:2], -1))
    pad = dim % 6
    if pad:
        ones = np.ones((*table.cos.shape[:2], pad), np.float32)
        table = Rope(np.concatenate([ones, table.cos], -1), np.concatenate([0 * ones, table.sin], -1))
    return table


@typechecked
def apply_rope(x: Float[Array, "batch seq heads head_dim"], rope: Rope) -> Float[Array, "batch seq heads head_dim"]:
    """``x`` with each adjacent channel pair rotated: ``out[2i] = x[2i] cos - x[2i+1] sin``, ``out[2i+1] = x[2i+1]
    cos + x[2i] sin``, in float32 (diffusers' ``apply_rotary_emb(use_real_unbind_dim=-1)``).

    The tables are ``[seq, head_dim]`` (shared by every head) or ``[seq, heads * head_dim]`` (one table over the
    whole inner dimension, LTX: its pairs run over the flat inner dimension, across heads where ``head_dim`` is
    odd), with an optional leading batch axis."""
    b, s, heads, head_dim = x.shape
    cos, sin = (jnp.asarray(t, jnp.float32) for t in rope)
    if cos.shape != sin.shape or cos.ndim not in (2, 3) or cos.shape[-2] != s:
        raise ValueError(f"apply_rope: tables of shapes {cos.shape} / {sin.shape} for x of shape {x.shape}; expected "
                         f"[(batch,) seq={s}, head_dim={head_dim} or heads*head_dim={heads * head_dim}]")
    if cos.shape[-1] == heads * head_dim:
        cos, sin = (t.reshape(*t.shape[:-1], heads, head_dim) for t in (cos, sin))
    elif cos.shape[-1] == head_dim and head_dim % 2 == 0:
        cos, sin = cos[..., None, :], sin[..., None, :]
    else:
        raise ValueError(f"apply_rope: tables with {cos.shape[-1]} channels for heads={heads} x head_dim={head_dim}; "
                         "expected an even head_dim (shared by the heads) or heads * head_dim")
    if cos.ndim == 3:
        cos, sin = cos[None], sin[None]
    xf = x.astype(jnp.float32)
    if (heads * head_dim) % 2:
        raise ValueError(f"apply_rope: heads * head_dim = {heads * head_dim} channels do not pair up; the inner "
                         "dimension must be even")
    # Pairs within each head; an odd head_dim's (a table over the inner dimension) straddle heads, as diffusers'
    # pairs over the flat inner dimension do.
    pairs = xf.reshape(b, s, heads, head_dim // 2, 2) if head_dim % 2 == 0 else xf.reshape(b, s, -1, 2)
    rotated = jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x.shape)
    return (xf * cos + rotated * sin).astype(x.dtype)


__all__ = ["Rope", "apply_rope", "flux_rope", "ltx_rope", "ltx_rope_frequencies", "rope_angles", "wan_rope"]
