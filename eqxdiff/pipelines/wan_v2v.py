"""Wan video-to-video (diffusers' ``WanVideoToVideoPipeline``): a video's VAE latents noised to ``strength`` and
denoised by a text-to-video Wan transformer, as image-to-image does for pictures.

>>> pipe = eqxdiff.load_pipeline("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", pipeline_class="WanVideoToVideoPipeline")
>>> video = pipe(frames, "a cat surfing a wave", strength=0.7)           # frames: uint8 [81, 480, 832, 3]

**The video** (``video``) is one clip (uint8 frames ``[F, H, W, 3]``, floats in [0, 1], or a list of PIL images)
for every output, or one clip per prompt (an array ``[n, F, H, W, 3]`` or a list of clips), as diffusers'
``VideoProcessor`` reads it. Its frame count is the output's (``F = 4k + 1``: the VAE's first frame, then ``k``
latent frames of 4) and its size is the output's: eqxdiff does not resize input videos (diffusers resizes them to
``height`` x ``width``, 480 x 832 by default), so ``height`` / ``width``, if given, must be its size. It is encoded by
the VAE (its posterior's mode), normalised by the VAE's ``latents_mean`` / ``latents_std``, and noised with the
call's noise to the first timestep that ``strength`` keeps (``N - int(N * strength)`` of ``N`` steps skipped; the
scheduler's ``add_noise`` at that step: ``(1 - sigma) x + sigma noise`` on flow sigmas, Wan's UniPC); the rest is
text-to-video's loop (:class:`~eqxdiff.pipelines.wan.WanPipeline`: prompts, guidance, a Wan 2.2 folder's two
experts). ``latents`` is that noise (``[n, T, h, w, C]``), never finished latents: diffusers' ``latents`` replace the
video instead. diffusers' pipeline ignores ``num_videos_per_prompt`` (one video per prompt); here it repeats each
prompt's video. diffusers sets no begin index: its scheduler finds the first step by the timestep's value, taking
the second of two equal ones, so where the first kept timestep is the first of a repeated integer value (many steps
at a high ``flow_shift``: 999, 999, ...) its sigmas run a step ahead of its loop and its last step fails (an
AssertionError; text-to-video too: 100 UniPC steps at ``flow_shift=12``); eqxdiff starts where ``strength`` says.
"""

from collections.abc import Sequence
from typing import ClassVar

import jax.numpy as jnp
import numpy as np

from .._typing import PRNGKeyArray
from ._arguments import prompt_list, resolve_key
from ._call import checked_call
from ._checks import InputError, InputTypeError, check_image_size, pixel_size
from ._images import clip_frames, to_model_range, video_clips
from .wan import MAX_SEQUENCE_LENGTH, WanPipeline
from .wan_i2v import condition_latents

__all__ = ["WanVideoToVideoPipeline"]

DEFAULT_STRENGTH = 0.8  # diffusers' WanVideoToVideoPipeline


class WanVideoToVideoPipeline(WanPipeline):
    """Wan video-to-video (diffusers' ``WanVideoToVideoPipeline``): uint8 frames ``[n, F, H, W, 3]`` from a video and
    prompts; see the module docstring, and :class:`~eqxdiff.pipelines.wan.WanPipeline` for prompts, the two experts
    and the rest. Any text-to-video folder runs as one (``pipeline_class="WanVideoToVideoPipeline"``)."""

    CLASS_NAME: ClassVar[str] = "WanVideoToVideoPipeline"
    INIT_IMAGE: ClassVar[str | None] = "video"
    REQUIRED_IMAGE: ClassVar[str | None] = "the video to start from: frames [F, H, W, 3] or a list of PIL images"

    def _check_channels(self) -> None:
        c, want = self.vae.config.latent_channels, self.transformer.config.in_channels
        if want != c:
            raise InputError(f"the transformer takes {want} input channels but video-to-video gives it the VAE's {c} "
                             "latents: this folder is not a text-to-video one (image-to-video folders run as "
                             "WanImageToVideoPipeline)")

    def video_pixels(self, video, prompts: int):
        """``video`` as ``[-1, 1]`` frames ``[k, F, H, W, 3]``: one clip (for every prompt) or one per prompt
        (``k = prompts``); the frame count ``4k + 1`` checked."""
        clips = video_clips(video)
        if not clips:
            raise InputError("pass video= (the video to start from: frames [F, H, W, 3] or a list of PIL images)")
        try:
            frames = [to_model_range(clip_frames(clip), "video") for clip in clips]
        except ValueError as e:  # (a TypeError stays one)
            raise (InputTypeError if isinstance(e, TypeError) else InputError)(
                f"{e if isinstance(e, InputError) else f'video: {e}'} (a clip is frames [F, H, W, 3] or a list of "
                "PIL images)") from None
        shapes = sorted({tuple(f.shape) for f in frames})
        if len(shapes) > 1:
            raise InputError(f"video: the clips differ in shape ({shapes}); pass clips of one frame count and size")
        count, t = frames[0].shape[0], self.vae_temporal_factor
        if (count - 1) % t:
            below = (count - 1) // t * t + 1
            raise InputError(f"video has {count} frames; Wan's VAE takes {t}k+1 frames (its first frame, then "
                             f"{t} per latent frame): trim it to {below} or extend it to {below + t} frames")
        if len(frames) not in (1, prompts):
            raise InputError(f"video holds {len(frames)} clips for {prompts} prompts; pass one clip (for every "
                             "prompt) or one per prompt")
        return jnp.stack(frames)

    def _size(self, pixels, height: int | None, width: int | None) -> tuple[int, int]:
        size = tuple(pixels.shape[2:4])
        for name, want, have in (("height", height, size[0]), ("width", width, size[1])):
            if want is not None and want != have:
                raise InputError(f"{name}={want} but the video is {pixel_size(*size)} pixels; resize the video "
                                 f"(eqxdiff does not resize input videos) or leave {name} unset")
        limits = self.call_limits()
        if limits.size_factor:
            check_image_size("video", pixels[0], limits.size_factor, limits.why_size())
        return size

    @checked_call
    def __call__(self, video=None, prompt: str | Sequence[str] | None = None, *,
                 negative_prompt: str | Sequence[str] | None = None, height: int | None = None,
                 width: int | None = None, num_inference_steps: int = 50, timesteps: Sequence[float] | None = None,
                 guidance_scale: float = 5.0,
                 strength: float = DEFAULT_STRENGTH, guidance_scale_2: float | None = None,
                 boundary_ratio: float | None = None, num_videos_per_prompt: int = 1, seed: int | None = None,
                 key: PRNGKeyArray | None = None, latents=None, prompt_embeds=None, negative_prompt_embeds=None,
                 max_sequence_length: int = MAX_SEQUENCE_LENGTH, output_type: str = "uint8", progress: bool = True):
        """Videos made from ``video`` with diffusers' ``WanVideoToVideoPipeline`` arguments: uint8 ``[n, F, height,
        width, 3]`` (the video's frames and size), or the final latents ``[n, T, h, w, C]`` with
        ``output_type="latent"``.

        The other arguments are :meth:`WanPipeline.__call__`'s, with the same meaning (``eqxdiff-generate --help``
        reads them there too).

        Args:
            video: The video to start from: frames [F, H, W, 3] (4k+1 of them; uint8 or floats in [0, 1]) or a list of
                PIL images; or one clip per prompt.
            height: Height in pixels (default: the video's; if given, the video's).
            width: Width in pixels (default: the video's; if given, the video's).
            strength: How far the video is noised: the fraction of the schedule that runs (1: from noise, the
                video's latents barely kept; lower keeps more of the video).
            timesteps: A custom schedule, descending, in place of num_inference_steps (schedulers that take one:
                flow-matching Euler; Wan's UniPC does not, as in diffusers).
            latents: The noise added to the video's latents ``[n, T, h, w, C]``, channels-last (an array).
        """
        self._check_channels()
        key = resolve_key(seed, key)
        prompts = (np.shape(prompt_embeds)[0] if prompt_embeds is not None else  # neither: self.prompts says so
                   len(prompt_list(prompt)) if prompt is not None else 1)
        pixels = self.video_pixels(video, prompts)  # checked before anything runs
        height, width = self._size(pixels, height, width)
        positive, negative = self.prompts(
            num_videos_per_prompt, prompt, negative_prompt, guided=guidance_scale > 1, prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds, max_sequence_length=max_sequence_length)
        with self.timed("encode_video"):
            init = condition_latents(self.vae, pixels, tiled=self.vae_tiling)  # each clip once, then one per video
            init = self.shard(jnp.repeat(init, positive.shape[0] // init.shape[0], axis=0))
        shape = self.video_latents_shape(positive.shape[0], pixels.shape[1], height, width, self.latent_channels)
        return self.generate(positive, negative, shape=shape, num_inference_steps=num_inference_steps,
                             guidance_scale=guidance_scale, guidance_scale_2=guidance_scale_2,
                             boundary_ratio=boundary_ratio, key=key, latents=latents, init_latents=init,
                             strength=strength, timesteps=timesteps, output_type=output_type, progress=progress)
