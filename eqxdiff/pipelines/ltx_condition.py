"""LTX-Video with conditions (diffusers' ``LTXConditionPipeline``, 0.9.5+; the family's folders load as it too): images
or video clips placed at frame indices with strengths, text-only generation, and the refinement of given latents
(``latents`` with ``denoise_strength``: the second stage of the two-stage recipe, after
:class:`~eqxdiff.pipelines.ltx_upsample.LTXLatentUpsamplePipeline`).

>>> pipe = eqxdiff.load_pipeline("Lightricks/LTX-Video-0.9.7-dev", pipeline_class=LTXConditionPipeline)
>>> video = pipe(image=[first, last], frame_index=[0, 120], prompt="...", num_frames=121, decode_timestep=0.05)

**Conditions** (``conditions``: :class:`LTXVideoCondition` s; or ``image`` / ``video``, one or a list each, with
``frame_index`` and ``strength`` one for all or one per condition, images first; diffusers instead pairs ``image[i]``
with ``video[i]``, one condition each with the image winning, as many as the shorter list (a lone image or clip, or
``None``, counts as a list of one): there ``image=[a, b]`` conditions on ``a`` alone and ``image=a, video=clip``
drops the clip, silently). Each picture (or clip, cut to the ``8k + 1`` frames that fit after its index) is the
video's size (eqxdiff does not resize) and is encoded by the VAE, its posterior sampled. At frame 0 its latents are
blended into the first latent frames (``lerp(noise, latents, strength)``); at a later index an image's (or a clip's
first two latent frames') latents become extra tokens put before the video's, positioned at that frame by their
``video_coords``, blended with noise by ``strength`` (a clip's later latent frames are blended into the video's
latent frames there). Every token carries its strength ``m``: its timestep is ``min(t, (1 - m) 1000)`` and it is
stepped only once ``t / 1000`` falls below ``1 - m`` (a strength-1 token never moves), each token from its own noise
level to the next of the schedule (diffusers' per-token steps, :class:`ConditionedEuler`). With
``image_cond_noise_scale`` (default 0.15; the model cards use 0.025 or 0) the strength-1 tokens are re-noised before
every step to ``latents + scale * noise * (t / 1000)^2``. Tokens are positioned in latent-pixel units (frames after
the first at ``8k - 7``, the time axis over ``frame_rate``). Every video of a call shares the conditions (diffusers'
pipeline builds a later index's extra tokens for one video only). Each video's prompt mask is its own prompt's:
diffusers' mask pairing with ``num_videos_per_prompt > 1`` is not copied (:mod:`eqxdiff.pipelines.ltx`, Prompts).

**Schedule.** ``timesteps`` (default: LTX-Video's linear-quadratic schedule of ``num_inference_steps``, times 1000;
the distilled models' recipes give their own), shifted by the scheduler's config (0.9.5+: static, stretched to its
``shift_terminal``; the transformer still sees the unstretched timesteps, as in diffusers). ``denoise_strength < 1``
runs the last ``int(N * denoise_strength)`` steps from ``latents`` (channels-last, normalised ``[n, T, h, w, C]``: a
previous call's ``output_type="latent"`` result, or the upsampler's) noised to the first of them. diffusers' condition
pipeline passes its scheduler no ``mu``, so a dynamically shifting one (0.9.0 / 0.9.1's folders) fails there; eqxdiff
shifts by the video's token count, as text-to-video does. With ``denoise_strength < 1`` and several videos, diffusers'
noise level (one per video) broadcasts against the latents' width: a size mismatch unless that width is the video
count (then harmless); eqxdiff noises every video to it.

**Draws.** From the call's key: the start noise (``noise_draws(key, shape).noise``), then per condition its
posterior sample and, at a later index, its blend noise, per step the re-noising, after the loop the decoder's
(:func:`condition_keys`, :func:`~eqxdiff.pipelines.ltx.decode_keys`), each as diffusers draws them from its
generator, in that order.
"""

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image

from .._typing import PRNGKeyArray
from ..core import program
from ..schedulers import FlowMatchEulerDiscreteScheduler, pad_schedule, to_device
from ._arguments import given_array, resolve_key
from ._call import checked_call
from ._checks import InputError, InputTypeError, pixel_size
from ._denoise import Denoiser, Guidance, Schedule
from ._images import clip_frames, is_picture, to_model_range, video_clips
from ._latents import noise_draws
from .ltx import (
    DEFAULT_FRAME_RATE,
    DEFAULT_FRAMES,
    LATENTS_LAYOUT,
    LTXPipeline,
    check_frame_rate,
    coords_rope,
    sampled_latents,
    shift_mu,
)
from .ltx_condition_tokens import ConditionTokens, conditioned_tokens, default_timesteps

__all__ = ["ConditionedEuler", "LTXConditionDenoiser", "LTXConditionPipeline", "LTXVideoCondition",
           "condition_keys", "condition_schedule"]

MAX_SEQUENCE_LENGTH = 256  # diffusers' LTXConditionPipeline default prompt length
_CONDITION_DRAWS = 0x2C0  # the call key's folds for the conditions' posterior and blend noise and the re-noising


# One picture (PIL, uint8 [H, W, 3] or floats in [0, 1]) and one clip (frames [F, H, W, 3], or a list of pictures):
# the call takes one or a list of each (so eqxdiff-generate's --image and --video repeat).
Picture = Image.Image | np.ndarray | jax.Array
Clip = np.ndarray | jax.Array | list[Image.Image]


@dataclasses.dataclass(frozen=True)
class LTXVideoCondition:
    """One condition (diffusers' ``LTXVideoCondition``): an ``image`` or a ``video`` clip, at ``frame_index``, with
    ``strength`` (1: the frames are given; less: a blend with noise that the loop keeps denoising)."""

    image: Any = None
    video: Any = None
    frame_index: int = 0
    strength: float = 1.0


def condition_keys(key: PRNGKeyArray) -> tuple[PRNGKeyArray, PRNGKeyArray, PRNGKeyArray]:
    """``(posterior, blend, step)``: the keys of a call's condition draws. Condition ``i``'s posterior sample is
    ``normal(fold_in(posterior, i), its latents' shape)``, its blend noise (a later index) ``normal(fold_in(blend, i),
    ...)``; the re-noising before step ``j`` (the schedule's index) ``normal(fold_in(step, j), tokens' shape)``."""
    return tuple(jax.random.fold_in(key, _CONDITION_DRAWS + i) for i in range(3))


# -- the per-token step and the model in the loop -----------------------------------------------------------------


class ConditionedEuler(eqx.Module):
    """Flow-matching Euler with a timestep per token (diffusers' ``step(..., per_token_timesteps=)`` as
    ``LTXConditionPipeline`` runs it), wrapping the pipeline's scheduler for :func:`~eqxdiff.pipelines.denoise_loop`.
    ``strength`` ``[1, seq]``: each token's condition strength ``m``. A token at step timestep ``t`` is at ``s =
    min(t, (1 - m) 1000) / 1000`` and goes to the largest sigma of the schedule below ``s - 1e-6`` (0 past the last),
    along ``-model_output``; it moves only where ``t / 1000 - 1e-6 < 1 - m``. The strengths are an array: new
    conditions compile nothing."""

    scheduler: FlowMatchEulerDiscreteScheduler
    strength: Any

    def stepper(self) -> "ConditionedEuler":
        return ConditionedEuler(self.scheduler.stepper(), self.strength)

    def remaining_steps(self, state):
        return self.scheduler.remaining_steps(state)

    def current_timestep(self, state):
        return self.scheduler.current_timestep(state)

    def scale_model_input(self, state, sample):
        return sample

    def step(self, state, model_output, sample, *, key=None, noise=None):
        t = self.current_timestep(state).astype(jnp.float32)
        m = self.strength.astype(jnp.float32)
        own = jnp.minimum(t, (1.0 - m) * 1000.0) / self.scheduler.config.num_train_timesteps  # [1, seq]
        sigmas = state.sigmas.astype(jnp.float32)[:, None, None]  # the padding repeats the final 0
        lower = jnp.max(jnp.where(sigmas < own[None] - 1e-6, sigmas, 0.0), axis=0)
        x = sample.astype(jnp.float32)
        stepped = x + ((own - lower)[..., None] * -model_output.astype(jnp.float32))
        moves = (t / 1000.0 - 1e-6 < 1.0 - m)[..., None]
        x = jnp.where(moves, stepped, x)
        return x.astype(sample.dtype), dataclasses.replace(state, step_index=state.step_index + 1)


@program
def renoised(x, init, strength, noise_scale, key, index, t):
    """diffusers' ``add_noise_to_image_conditioning_latents`` before the step at schedule ``index`` (timestep ``t``):
    the strength-1 tokens become ``init + noise_scale * noise * (t / 1000)^2``, the others stay."""
    noise = jax.random.normal(jax.random.fold_in(key, index), x.shape, jnp.float32)
    noised = init + noise_scale * noise * jnp.square(t.astype(jnp.float32) / 1000.0)
    return jnp.where((strength > 1.0 - 1e-6)[..., None], noised.astype(x.dtype), x)


class LTXConditionDenoiser(Denoiser):
    """The LTX-Video transformer on packed tokens ``[b, seq, features]`` (the conditions' extra tokens first).
    ``cond``: ``embeds`` / ``mask`` (T5's), ``rope`` (of the tokens' ``video_coords``), ``strength`` ``[1, seq]``
    (each token's timestep is ``min(t, (1 - strength) 1000)``) and, with image or video conditions, ``init`` (the
    start tokens), ``noise_scale`` and ``step_key``: after each step but the last, the strength-1 tokens are re-noised
    for the next (:func:`renoised`)."""

    transformer: Any
    dtype: Any = eqx.field(static=True, default=jnp.float32)

    def __call__(self, x, t, cond, *, step):
        timestep = jnp.minimum(t.astype(jnp.float32), (1.0 - cond["strength"]) * 1000.0)
        return self.transformer.forward_tokens(x.astype(self.dtype), cond["embeds"], timestep, cond["mask"],
                                               cond["rope"])

    def after_step(self, x, t, cond, *, step, scheduler, state, last):
        if "init" not in cond:
            return x
        again = renoised(x, cond["init"], cond["strength"], cond["noise_scale"], cond["step_key"], state.step_index,
                         scheduler.current_timestep(state))
        return jnp.where(last, x, again)


# -- the pipeline -------------------------------------------------------------------------------------------------


class LTXConditionPipeline(LTXPipeline):
    """LTX-Video with conditions at frame indices (diffusers' ``LTXConditionPipeline``): uint8 frames ``[n,
    num_frames, height, width, 3]``; see the module docstring, and :class:`~eqxdiff.pipelines.ltx.LTXPipeline` for
    prompts and decoding."""

    CLASS_NAME: ClassVar[str] = "LTXConditionPipeline"
    INIT_IMAGE: ClassVar[str | None] = "image"
    T5_MASK: ClassVar[bool] = True  # diffusers' condition pipeline encodes the prompts with their mask

    @classmethod
    def check_arguments(cls, arguments, limits=None) -> None:
        """The shared checks, with ``strength`` the conditions' (one number in [0, 1] or one per condition, not an
        image-to-image strength), ``denoise_strength`` in (0, 1] and ``image_cond_noise_scale`` at least 0."""
        arguments = dict(arguments)
        _check_counts(arguments)
        for name, low in (("strength", 0.0), ("frame_index", 0)):
            values = arguments.pop(name, None)
            values = [] if values is None else list(values) if isinstance(values, (list, tuple)) else [values]
            kind = (int, np.integer) if name == "frame_index" else (int, float, np.integer, np.floating)
            if any(isinstance(v, bool) or not isinstance(v, kind) for v in values) or any(
                    not low <= v <= (1.0 if name == "strength" else np.inf) for v in values):
                what = "numbers in [0, 1]" if name == "strength" else "frame indices (ints >= 0)"
                raise InputError(f"{name}={values if len(values) > 1 else values[0]!r}: give {what}, one for every "
                                 "condition or one per condition")
        ds = arguments.get("denoise_strength")
        if ds is not None and (isinstance(ds, bool) or not isinstance(ds, (int, float)) or not 0 < ds <= 1):
            raise InputError(f"denoise_strength={ds!r} must be in (0, 1]: the fraction of the schedule that refines "
                             "the given latents (1: generate from noise)")
        scale = arguments.get("image_cond_noise_scale")
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale >= 0):
            raise InputError(f"image_cond_noise_scale={scale!r} must be a number >= 0 (0.025 and 0.15 are usual)")
        super().check_arguments(arguments, limits)

    def check_call(self, arguments) -> None:
        """The frame rate, the schedule (``timesteps`` or the steps' default, with ``denoise_strength``) and a
        scheduler that steps per token (module functions only: eqxdiff-generate checks with a stand-in ``self``)."""
        if not isinstance(self.scheduler, FlowMatchEulerDiscreteScheduler) or \
                self.scheduler.config.stochastic_sampling:
            raise InputError(f"LTXConditionPipeline steps each token from its own timestep with flow-matching Euler, "
                             f"not {type(self.scheduler).__name__} (or stochastic sampling); use the folder's "
                             "FlowMatchEulerDiscreteScheduler")
        if "frame_rate" in arguments:
            check_frame_rate(arguments["frame_rate"])
        condition_schedule(self.scheduler, arguments.get("num_inference_steps") or 1, arguments.get("timesteps"),
                           arguments.get("denoise_strength", 1.0), (1, 1, 1, 1, 1))

    def condition_schedule(self, num_inference_steps: int, timesteps, denoise_strength: float, shape):
        """:func:`condition_schedule` on the pipeline's scheduler."""
        return condition_schedule(self.scheduler, num_inference_steps, timesteps, denoise_strength, shape)

    def conditions(self, conditions, image, video, frame_index, strength) -> list[LTXVideoCondition]:
        """The call's conditions as a list: ``conditions`` as given, or one per image, then one per video clip, with
        their frame indices and strengths (one value for all, or one per condition)."""
        if conditions is not None:
            if image is not None or video is not None:
                raise InputError("pass conditions= or image= / video=, not both")
            return list(conditions) if isinstance(conditions, (list, tuple)) else [conditions]
        found = [LTXVideoCondition(image=i) for i in _images(image)] + [LTXVideoCondition(video=v)
                                                                         for v in video_clips(video)]
        indices, strengths = (_per_condition(v, len(found), n) for v, n in ((frame_index, "frame_index"),
                                                                             (strength, "strength")))
        return [dataclasses.replace(c, frame_index=int(i), strength=float(s))
                for c, i, s in zip(found, indices, strengths)]

    def condition_pixels(self, condition: LTXVideoCondition, *, size: tuple[int, int], num_frames: int):
        """One condition's pixels ``[1, F, H, W, 3]`` in [-1, 1] (a clip cut to the ``8k + 1`` frames that fit after
        its index, as diffusers' ``trim_conditioning_sequence``), checked against the video's ``size``."""
        if (condition.image is None) == (condition.video is None):
            raise InputError("each condition holds an image or a video clip (one of them)")
        index, t = condition.frame_index, self.vae_temporal_factor
        if not 0 <= index < num_frames:
            raise InputError(f"frame_index={index} lies outside the video's {num_frames} frames; pass 0 to "
                             f"{num_frames - 1}")
        frames = to_model_range(*((condition.image, "image") if condition.video is None else
                                  (clip_frames(condition.video), "video")))
        if condition.video is None and frames.shape[0] != 1:
            raise InputError(f"an image condition holds {frames.shape[0]} images; pass one picture per condition")
        if tuple(frames.shape[1:3]) != tuple(size):
            raise InputError(f"a condition's frames have {pixel_size(*frames.shape[1:3])} pixels but the video has "
                             f"{pixel_size(*size)}; resize or crop them (eqxdiff does not resize inputs)")
        keep = (min(frames.shape[0], num_frames - index) - 1) // t * t + 1
        return frames[None, :keep]

    def condition_latents(self, conditions, *, shape, num_frames: int, key) -> list:
        """Each condition's sampled, normalised latents ``[1, f, h, w, C]`` (draws: :func:`condition_keys`)."""
        f = self.vae_scale_factor
        posterior, _, _ = condition_keys(key)
        out = []
        for i, c in enumerate(conditions):
            pixels = self.condition_pixels(c, size=(shape[2] * f, shape[3] * f), num_frames=num_frames)
            latent_shape = (1, (pixels.shape[1] - 1) // self.vae_temporal_factor + 1, *shape[2:])
            out.append(sampled_latents(self.vae, pixels, jax.random.normal(jax.random.fold_in(posterior, i),
                                                                           latent_shape, jnp.float32)))
        return out

    def prepare_tokens(self, conditions, *, shape, num_frames: int, key, latents=None, sigma: float = 1.0
                       ) -> ConditionTokens:
        """The start tokens, their strengths and coordinates (:func:`conditioned_tokens`) from the call's noise (or
        the given ``latents`` noised to ``sigma``) and its conditions."""
        x = noise_draws(key, shape).noise
        if latents is not None:
            s = np.float32(sigma)
            x = s * x + (1 - s) * given_array(latents, shape, "latents", LATENTS_LAYOUT)
        encoded = self.condition_latents(conditions, shape=shape, num_frames=num_frames, key=key)
        c = self.transformer.config
        return conditioned_tokens(x, conditions, encoded, blend_key=condition_keys(key)[1],
                                  temporal=self.vae_temporal_factor, spatial=self.vae_scale_factor,
                                  patch=(c.patch_size_t, c.patch_size, c.patch_size))

    def generate_conditioned(self, positive, negative, conditions, *, shape, num_frames: int, key, schedule,
                             sigma: float, guidance_scale: float, guidance_rescale: float, frame_rate,
                             image_cond_noise_scale: float, latents, output_type: str, progress: bool, decode: dict):
        """The loop on the conditioned tokens and the decode of the video's (the conditions' extra tokens dropped)."""
        guidance = Guidance(guidance_scale, guidance_rescale, enabled=guidance_scale > 1)
        with self.timed("prepare"):
            prepared = self.prepare_tokens(conditions, shape=shape, num_frames=num_frames, key=key, latents=latents,
                                           sigma=sigma)
            coords = prepared.coords.copy()
            coords[:, 0] *= np.float32(1.0 / frame_rate)
            cond = self.conditioning(positive, negative, coords_rope(self.transformer, to_device(coords)))
            cond["strength"] = to_device(prepared.strength)
            x = self.shard(prepared.tokens)
            if conditions:
                step_key = condition_keys(key)[2]
                cond.update(init=x, noise_scale=to_device(np.float32(image_cond_noise_scale)), step_key=step_key)
                x = renoised(x, x, cond["strength"], cond["noise_scale"], step_key, schedule.state.step_index,
                             self.scheduler.current_timestep(schedule.state))
            x = jax.block_until_ready(x)
        x = self.run_loop(LTXConditionDenoiser(self.transformer, self.activations_dtype),
                          ConditionedEuler(self.scheduler, cond["strength"]), schedule.state, x, cond,
                          noise_draws(key, shape).loop_key, guidance=guidance, num_steps=schedule.num_steps,
                          progress=progress)
        c = self.transformer.config
        video = prepared.unpack(x, (c.patch_size_t, c.patch_size, c.patch_size))
        return self.finish(video, output_type, guided_by=f"guidance_scale (now {guidance_scale:g})"
                           if guidance.enabled else None, **decode)

    @checked_call
    def __call__(self, conditions: LTXVideoCondition | Sequence[LTXVideoCondition] | None = None,
                 image: Picture | Sequence[Picture] | None = None, video: Clip | Sequence[Clip] | None = None,
                 frame_index: int | Sequence[int] = 0, strength: float | Sequence[float] = 1.0,
                 denoise_strength: float = 1.0, prompt: str | Sequence[str] | None = None, *,
                 negative_prompt: str | Sequence[str] | None = None, height: int | None = None,
                 width: int | None = None, num_frames: int = DEFAULT_FRAMES, frame_rate: float = DEFAULT_FRAME_RATE,
                 num_inference_steps: int = 50, timesteps: Sequence[float] | None = None, guidance_scale: float = 3.0,
                 guidance_rescale: float = 0.0, image_cond_noise_scale: float = 0.15, num_videos_per_prompt: int = 1,
                 seed: int | None = None, key: PRNGKeyArray | None = None, latents=None, prompt_embeds=None,
                 prompt_attention_mask=None, negative_prompt_embeds=None, negative_prompt_attention_mask=None,
                 decode_timestep: float | Sequence[float] = 0.0,
                 decode_noise_scale: float | Sequence[float] | None = None,
                 max_sequence_length: int = MAX_SEQUENCE_LENGTH, output_type: str = "uint8", progress: bool = True):
        """Videos with diffusers' ``LTXConditionPipeline`` arguments: uint8 ``[n, num_frames, height, width, 3]``, or
        the final latents ``[n, T, h, w, C]`` with ``output_type="latent"``.

        The other arguments are :meth:`LTXPipeline.__call__`'s, with the same meaning (``eqxdiff-generate --help`` reads
        them there too).

        Args:
            conditions: LTXVideoCondition s (image or video, frame_index, strength), instead of image / video.
            image: A picture (or a list) to place at frame_index; the video's size.
            video: A clip (frames [F, H, W, 3], or a list of clips) to place from frame_index; the video's size.
            frame_index: Where each condition starts (one for all, or one per condition: images, then clips).
            strength: How firmly each condition holds, 1 = exactly (one for all, or one per condition).
            denoise_strength: The fraction of the schedule that refines the given latents (1: generate from noise).
            num_frames: Frames per video, 8k+1.
            num_inference_steps: Number of denoising steps (of LTX-Video's linear-quadratic schedule).
            timesteps: A custom schedule of timesteps from 1000 down (the distilled models' recipes).
            guidance_scale: Classifier-free guidance scale; 1 or less turns guidance off.
            image_cond_noise_scale: Noise added to the strength-1 conditions before each step, times (t/1000)^2.
            latents: Video latents [n, T, h, w, C] (normalised, channels-last) refined with denoise_strength < 1.
        """
        if latents is not None and denoise_strength >= 1:
            raise InputError("latents are refined with denoise_strength < 1 (0.4 is the two-stage recipe's); with "
                             "denoise_strength=1 the video starts from noise: leave latents out")
        key = resolve_key(seed, key)
        found = self.conditions(conditions, image, video, frame_index, strength)
        positive, negative = self.prompts(
            num_videos_per_prompt, prompt=prompt, negative_prompt=negative_prompt, guided=guidance_scale > 1,
            prompt_embeds=prompt_embeds, prompt_attention_mask=prompt_attention_mask,
            negative_prompt_embeds=negative_prompt_embeds,
            negative_prompt_attention_mask=negative_prompt_attention_mask, max_sequence_length=max_sequence_length)
        shape = self.video_shape(positive.embeds.shape[0], num_frames, height, width)
        schedule, sigma = self.condition_schedule(num_inference_steps, timesteps, denoise_strength, shape)
        return self.generate_conditioned(
            positive, negative, found, shape=shape, num_frames=num_frames, key=key, schedule=schedule, sigma=sigma,
            guidance_scale=guidance_scale, guidance_rescale=guidance_rescale, frame_rate=frame_rate,
            image_cond_noise_scale=image_cond_noise_scale, latents=latents, output_type=output_type,
            progress=progress, decode=self.decode_options(decode_timestep, decode_noise_scale, shape[0], key))


def condition_schedule(scheduler, num_inference_steps: int, timesteps, denoise_strength: float, shape):
    """``(schedule, sigma)``: the custom ``timesteps`` (default :func:`default_timesteps`) with ``mu`` for ``shape``,
    started ``N - int(N * denoise_strength)`` steps in (diffusers' ``get_timesteps``), and the noise level there (what
    given latents are noised to)."""
    ts = default_timesteps(num_inference_steps) if timesteps is None else np.asarray(timesteps, np.float32)
    n = len(ts)
    begin = n - min(int(n * denoise_strength), n) if denoise_strength < 1 else 0
    if begin >= n:
        raise InputError(f"denoise_strength={denoise_strength} of {n} steps leaves no step to run; raise it (or the "
                         "steps)")
    state = scheduler.init(None, sample_shape=shape, timesteps=list(ts), mu=shift_mu(scheduler, shape),
                           begin_index=begin)
    return Schedule(pad_schedule(state), n - begin), float(np.asarray(state.sigmas)[begin])


def _images(image) -> list:
    """``image`` as a list of pictures: one picture, a ``[k, H, W, 3]`` array of ``k``, or a list of pictures."""
    if image is None:
        return []
    if is_picture(image):
        return [image]
    if isinstance(image, (np.ndarray, jax.Array)) and np.ndim(image) == 4:
        return [image[i] for i in range(image.shape[0])]
    return list(image)


def _check_counts(arguments) -> None:
    """Before anything runs: ``frame_index`` and ``strength`` give one value, or one per condition of ``image`` /
    ``video``, and each frame index lies inside the video's ``num_frames``; ``conditions``:
    :func:`_check_conditions`."""
    frames = arguments.get("num_frames")
    if arguments.get("conditions") is not None:
        _check_conditions(arguments)
        return
    count = len(_images(arguments.get("image"))) + len(video_clips(arguments.get("video")))
    if not count:
        return
    for name in ("frame_index", "strength"):
        if name in arguments:
            _per_condition(arguments[name], count, name)
    index = arguments.get("frame_index", 0)
    for i in index if isinstance(index, (list, tuple)) else [index]:
        _check_index(i, frames)


def _check_index(index, frames) -> None:
    if isinstance(frames, int) and isinstance(index, int) and not index < frames:
        raise InputError(f"frame_index={index} lies outside the video's {frames} frames; pass 0 to {frames - 1}")


def _check_conditions(arguments) -> None:
    """``conditions``: LTXVideoCondition s, each an image or a clip at a frame index inside the video with a strength
    in [0, 1], and no call-level ``frame_index`` / ``strength`` beside them (diffusers replaces those by the
    conditions' own without a word: a value given there would be dropped)."""
    conditions = arguments["conditions"]
    conditions = list(conditions) if isinstance(conditions, (list, tuple)) else [conditions]
    for name, default in (("frame_index", 0), ("strength", 1.0)):
        if arguments.get(name, default) != default:
            raise InputError(f"{name}={arguments[name]!r} applies to image= / video=; with conditions= set each "
                             f"LTXVideoCondition's {name} (LTXVideoCondition(image=..., {name}=...))")
    for c in conditions:
        if not isinstance(c, LTXVideoCondition):
            raise InputTypeError(f"conditions must be LTXVideoCondition s (eqxdiff.pipelines.ltx_condition: "
                                 f"LTXVideoCondition(image=..., frame_index=..., strength=...)), got "
                                 f"{type(c).__name__}")
        if (c.image is None) == (c.video is None):
            raise InputError("each condition holds an image or a video clip (one of them)")
        if isinstance(c.frame_index, bool) or not isinstance(c.frame_index, (int, np.integer)) or c.frame_index < 0:
            raise InputError(f"a condition's frame_index={c.frame_index!r}: give a frame index (an int >= 0)")
        _check_index(int(c.frame_index), arguments.get("num_frames"))
        s = c.strength
        if isinstance(s, bool) or not isinstance(s, (int, float, np.integer, np.floating)) or not 0 <= s <= 1:
            raise InputError(f"a condition's strength={s!r}: give a number in [0, 1] (1: the frames are given)")


def _per_condition(value, count: int, name: str) -> list:
    values = list(value) if isinstance(value, (list, tuple)) else [value] * count
    if len(values) != count:
        raise InputError(f"{name} has {len(values)} value{'s' * (len(values) != 1)} for {count} "
                         f"condition{'s' * (count != 1)}; pass one, or one per condition (images first, then video "
                         "clips)")
    return values
