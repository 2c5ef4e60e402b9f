"""The token sequence of an LTX-Video condition call (:mod:`eqxdiff.pipelines.ltx_condition`): where each condition's
latents go (blended into the video's latent frames, or extra tokens before the video's), each token's strength and
its coordinates, and the default schedule, as diffusers' ``LTXConditionPipeline.prepare_latents`` builds them.

What depends on the conditions' shapes and frame indices (which frames, how many extra tokens) is static; the
latents, the strengths and the noise are traced (:func:`assemble`): new strengths or pictures of the same sizes compile
nothing.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..core import program
from ..models.ltx import pack_latents, unpack_latents
from ._checks import InputError

__all__ = ["PREFIX_LATENT_FRAMES", "ConditionTokens", "Placement", "assemble", "conditioned_tokens",
           "default_timesteps", "lerp", "linear_quadratic_schedule", "placements", "scaled_ids", "video_ids"]

PREFIX_LATENT_FRAMES = 2  # diffusers' num_prefix_latent_frames: a clip at a later index keeps its first two as tokens


def linear_quadratic_schedule(num_steps: int, threshold_noise: float = 0.025, linear_steps: int | None = None
                              ) -> np.ndarray:
    """LTX-Video's sigmas (``ltx_video/schedulers/rf.py``, diffusers' ``linear_quadratic_schedule``): linear to
    ``threshold_noise`` over the first half of the steps, then quadratic to 1, reversed; float32 ``[num_steps]``."""
    if num_steps < 2:
        return np.ones(1, np.float32)
    linear_steps = num_steps // 2 if linear_steps is None else linear_steps
    linear = [i * threshold_noise / linear_steps for i in range(linear_steps)]
    diff = linear_steps - threshold_noise * num_steps
    quadratic_steps = num_steps - linear_steps
    a = diff / (linear_steps * quadratic_steps ** 2)
    b = threshold_noise / linear_steps - 2 * diff / quadratic_steps ** 2
    c = a * linear_steps ** 2
    schedule = linear + [a * i ** 2 + b * i + c for i in range(linear_steps, num_steps)] + [1.0]
    return np.asarray([1.0 - s for s in schedule[:-1]], np.float32)


def default_timesteps(num_steps: int) -> np.ndarray:
    """The condition pipeline's default timesteps: :func:`linear_quadratic_schedule` times 1000, in float32."""
    return linear_quadratic_schedule(num_steps) * np.float32(1000)


def lerp(start, end, weight):
    """``torch.lerp`` with a weight array, as PyTorch computes it: ``start + w (end - start)`` below 0.5, else
    ``end - (end - start)(1 - w)`` (so a weight of 1 gives ``end`` exactly)."""
    w = jnp.asarray(weight, jnp.float32)
    diff = end - start
    return jnp.where(w < 0.5, start + w * diff, end - diff * (1.0 - w))


def video_ids(frames: int, height: int, width: int, patch: tuple[int, int, int]) -> np.ndarray:
    """diffusers' ``_prepare_video_ids``: the latent coordinates ``[3, tokens]`` (frame, row, column; every
    ``patch``-th) of a grid of that size, in token order."""
    pt, p, _ = patch
    mesh = np.meshgrid(np.arange(0, frames, pt), np.arange(0, height, p), np.arange(0, width, p), indexing="ij")
    return np.stack(mesh).reshape(3, -1)


def scaled_ids(ids: np.ndarray, temporal: int, spatial: int, frame_index: int) -> np.ndarray:
    """diffusers' ``_scale_video_ids``: latent coordinates in pixels, the first latent frame at pixel frame 0 and
    latent frame ``k`` at ``8k - 7`` (the causal VAE's), moved by ``frame_index``."""
    out = ids * np.asarray([temporal, spatial, spatial])[:, None]
    out[0] = np.maximum(out[0] + 1 - temporal, 0) + frame_index
    return out


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one condition's ``frames`` latent frames go: ``grid`` (``(start, end)`` latent frames of the video
    blended with the condition's from ``grid_from`` on; ``None``: none) and ``extra`` latent frames (its first ones)
    that become tokens before the video's, at ``frame_index``."""

    frames: int
    frame_index: int
    grid: tuple[int, int] | None
    grid_from: int
    extra: int


def placements(frame_indices, frames, temporal: int) -> tuple[Placement, ...]:
    """The placements of conditions at ``frame_indices`` of ``frames`` latent frames each (diffusers' rules: at frame
    0 blended into the first frames; at a later index an image, or a clip's first two latent frames, as extra
    tokens and a clip's later latent frames blended into the video's from ``index // 8 + 2``)."""
    out = []
    for index, f in zip(frame_indices, frames):
        if index == 0:
            out.append(Placement(f, 0, (0, f), 0, 0))
        elif f > PREFIX_LATENT_FRAMES:
            start = index // temporal + PREFIX_LATENT_FRAMES
            out.append(Placement(f, index, (start, start + f - PREFIX_LATENT_FRAMES), PREFIX_LATENT_FRAMES,
                                 PREFIX_LATENT_FRAMES))
        else:
            out.append(Placement(f, index, None, 0, f))
    return tuple(out)


@program
def assemble(x, encoded: tuple, strengths, blend_key, where: tuple[Placement, ...], patch: tuple[int, int, int]):
    """The start tokens ``[n, extra + video, features]``: the video's latents ``x [n, T, h, w, C]`` with the
    conditions' latents (``encoded``, each ``[1, f, h, w, C]``) blended in by ``strengths [k]`` where their placement
    says, and their extra latent frames blended with noise (``normal(fold_in(blend_key, i))``) by their strength and
    packed in front (in the conditions' order)."""
    pt, p, _ = patch
    extras = []
    for i, (z, place) in enumerate(zip(encoded, where)):
        w = strengths[i]
        if place.grid is not None:
            a, b = place.grid
            x = x.at[:, a:b].set(lerp(x[:, a:b], z[:, place.grid_from:], w))
        if place.extra:
            z = z[:, :place.extra]
            z = lerp(jax.random.normal(jax.random.fold_in(blend_key, i), z.shape, jnp.float32), z, w)
            extras.append(jnp.repeat(pack_latents(z, p, pt), x.shape[0], axis=0))
    return jnp.concatenate([*extras, pack_latents(x, p, pt)], axis=1)


@dataclasses.dataclass(frozen=True)
class ConditionTokens:
    """A condition call's start ``tokens`` ``[n, seq, features]``, each token's ``strength`` ``[1, seq]`` and
    ``coords`` ``[1, 3, seq]`` (latent pixels, float32; the time axis not yet over the frame rate), the number of
    ``extra`` tokens in front and the video's token ``grid``."""

    tokens: Any
    strength: np.ndarray
    coords: np.ndarray
    extra: int
    grid: tuple[int, int, int]

    def unpack(self, tokens, patch: tuple[int, int, int]):
        """The video's latents ``[n, T, h, w, C]`` from tokens in this layout (the extra tokens dropped)."""
        return unpack_latents(tokens[:, self.extra:], self.grid, patch[1], patch[0])


def conditioned_tokens(x, conditions, encoded, *, blend_key, temporal: int, spatial: int,
                       patch: tuple[int, int, int]) -> ConditionTokens:
    """The tokens of a call (:class:`ConditionTokens`) from its start latents ``x [n, T, h, w, C]``, its
    ``conditions`` (``frame_index``, ``strength``) and their ``encoded`` latents."""
    _, t, h, w, _ = x.shape
    where = placements([c.frame_index for c in conditions], [z.shape[1] for z in encoded], temporal)
    frame_strength = np.zeros(t, np.float32)
    strengths, coords = [], []
    for c, place in zip(conditions, where):
        if place.grid is not None:
            a, b = place.grid
            if b > t:
                raise InputError(f"a condition of {place.frames} latent frames at frame_index={c.frame_index} runs past "
                                 f"the video's {t} latent frames; place it earlier or cut it")
            frame_strength[a:b] = c.strength
        if place.extra:
            ids = video_ids(place.extra, h, w, patch)
            coords.append(scaled_ids(ids, temporal, spatial, c.frame_index))
            strengths.append(np.full(ids.shape[1], c.strength, np.float32))
    grid_ids = video_ids(t, h, w, patch)
    strengths.append(frame_strength[grid_ids[0]])
    coords.append(scaled_ids(grid_ids, temporal, spatial, 0))
    weights = np.asarray([c.strength for c in conditions], np.float32)
    tokens = assemble(x, tuple(encoded), jax.device_put(weights), blend_key, where, patch)
    extra = sum(s.shape[0] for s in strengths[:-1])
    pt, p, _ = patch
    return ConditionTokens(tokens, np.concatenate(strengths)[None], np.concatenate(coords, axis=1)[None].astype(
        np.float32), extra, (t // pt, h // p, w // p))
