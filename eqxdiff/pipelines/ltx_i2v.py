"""LTX-Video image-to-video (diffusers' ``LTXImageToVideoPipeline``; the family's folders load as it too): the first
frame is the image's, conditioned through per-token timesteps and a conditioning mask.

>>> pipe = eqxdiff.load_pipeline("Lightricks/LTX-Video-0.9.5", dtype="bfloat16",
...                              pipeline_class=LTXImageToVideoPipeline)
>>> video = pipe(image, "the cat turns its head", num_frames=121, decode_timestep=0.05)   # image: uint8 [512, 704, 3]

**The image** (uint8 ``[H, W, 3]`` or ``[1, H, W, 3]``, a PIL image, floats in [0, 1]; its size is the video's:
eqxdiff does not resize input images; or one per prompt, ``[n, H, W, 3]`` or a list, each for its prompt's videos;
another count is refused) is encoded by the VAE as a one-frame video and its posterior **sampled** (as diffusers'
``retrieve_latents`` samples it), each video its own draw from the call's key (``noise_draws(key, shape).image``'s
first latent frame), then normalised as the denoised latents are. (diffusers samples one image's posterior once for
all its videos, and fails on one image per prompt with ``num_videos_per_prompt > 1``.) The start latents are the
image's latents on the first latent frame and the noise after it (``latents``, if given, is that noise; diffusers
takes given latents as the start latents themselves, its image then unused). At every step the first frame's tokens
get the timestep 0 (``t * (1 - mask)`` per token) and after the scheduler's step the first frame is the image's again
(diffusers steps only the frames after it): the output's first frame decodes the image's latents. A patched
transformer's tokens take the timestep of their patch's first frame (diffusers' image-to-video runs patch-1
transformers only).
"""

from collections.abc import Sequence
from typing import ClassVar

import jax.numpy as jnp
import numpy as np

from .._typing import PRNGKeyArray
from ..schedulers import to_device
from ._arguments import resolve_key
from ._call import checked_call
from ._checks import picture_size, prompt_count
from ._latents import noise_draws
from .ltx import (
    DEFAULT_FRAME_RATE,
    DEFAULT_FRAMES,
    MAX_SEQUENCE_LENGTH,
    LTXPipeline,
    one_picture,
    sampled_latents,
)

__all__ = ["LTXImageToVideoPipeline"]


class LTXImageToVideoPipeline(LTXPipeline):
    """LTX-Video image-to-video (diffusers' ``LTXImageToVideoPipeline``): uint8 frames ``[n, num_frames, height,
    width, 3]`` starting from an image; see the module docstring, and :class:`~eqxdiff.pipelines.ltx.LTXPipeline` for
    prompts, the schedule and decoding."""

    CLASS_NAME: ClassVar[str] = "LTXImageToVideoPipeline"
    INIT_IMAGE: ClassVar[str | None] = "image"
    REQUIRED_IMAGE: ClassVar[str | None] = "the first frame of the video"

    def image_condition(self, image, *, shape, key: PRNGKeyArray, prompts: int = 1) -> dict:
        """The image's arrays for latents of ``shape`` (:class:`~eqxdiff.pipelines.ltx.LTXDenoiser`): its sampled
        latents on the first frame (``first_frame`` ``[n, 1, h, w, C]``; one image for every video, or one per
        prompt for its videos), the ``frame_mask`` and the ``token_mask`` of the per-token timesteps."""
        _, t, h, w, _ = shape
        f = self.vae_scale_factor
        pixels = one_picture(image, "image", (h * f, w * f), prompts=prompts)
        first = sampled_latents(self.vae, pixels[:, None], noise_draws(key, shape).image[:, :1])
        mask = np.ones((1, t, h, w, 1), np.float32)
        mask[:, 0] = 0.0  # 1 on the frames the loop steps
        c = self.transformer.config  # each token's timestep follows its patch's first frame
        tokens = mask[0, ::c.patch_size_t, ::c.patch_size, ::c.patch_size, 0].reshape(1, -1)
        return {"first_frame": first.astype(jnp.float32), "frame_mask": to_device(mask),
                "token_mask": to_device(tokens)}

    @checked_call
    def __call__(self, image=None, prompt: str | Sequence[str] | None = None, *,
                 negative_prompt: str | Sequence[str] | None = None, height: int | None = None,
                 width: int | None = None, num_frames: int = DEFAULT_FRAMES, frame_rate: float = DEFAULT_FRAME_RATE,
                 num_inference_steps: int = 50, timesteps: Sequence[float] | None = None, guidance_scale: float = 3.0,
                 guidance_rescale: float = 0.0, num_videos_per_prompt: int = 1, seed: int | None = None,
                 key: PRNGKeyArray | None = None, latents=None, prompt_embeds=None, prompt_attention_mask=None,
                 negative_prompt_embeds=None, negative_prompt_attention_mask=None,
                 decode_timestep: float | Sequence[float] = 0.0,
                 decode_noise_scale: float | Sequence[float] | None = None,
                 max_sequence_length: int = MAX_SEQUENCE_LENGTH, output_type: str = "uint8", progress: bool = True):
        """Videos starting from ``image`` with diffusers' ``LTXImageToVideoPipeline`` arguments: uint8 ``[n,
        num_frames, height, width, 3]``, or the final latents ``[n, T, h, w, C]`` with ``output_type="latent"``.

        The other arguments are :meth:`LTXPipeline.__call__`'s, with the same meaning (``eqxdiff-generate --help`` reads
        them there too).

        Args:
            image: The first frame (its size is the video's): one picture for every video, or one per prompt.
            height: Height in pixels (default: the image's; if given, the image's).
            width: Width in pixels (default: the image's; if given, the image's).
            num_frames: Frames per video, 8k+1.
            timesteps: A custom schedule of timesteps from 1000 down, instead of num_inference_steps' sigmas.
            guidance_scale: Classifier-free guidance scale; 1 or less turns guidance off.
            latents: The initial noise ``[n, T, h, w, C]``, channels-last (its first frame is replaced by the
                image's latents).
        """
        size = picture_size(image)
        prompts = prompt_count({"prompt": prompt, "prompt_embeds": prompt_embeds})
        if prompts is not None:  # the image's count for the prompts, before anything is encoded
            one_picture(image, "image", (height or size[0], width or size[1]), prompts=prompts)
        key = resolve_key(seed, key)
        positive, negative = self.prompts(
            num_videos_per_prompt, prompt=prompt, negative_prompt=negative_prompt, guided=guidance_scale > 1,
            prompt_embeds=prompt_embeds, prompt_attention_mask=prompt_attention_mask,
            negative_prompt_embeds=negative_prompt_embeds,
            negative_prompt_attention_mask=negative_prompt_attention_mask, max_sequence_length=max_sequence_length)
        shape = self.video_shape(positive.embeds.shape[0], num_frames, height or size[0], width or size[1])
        with self.timed("encode_image"):
            condition = self.image_condition(image, shape=shape, key=key,
                                             prompts=positive.embeds.shape[0] // num_videos_per_prompt)
        return self.generate(positive, negative, shape=shape, key=key, num_inference_steps=num_inference_steps,
                             timesteps=timesteps, guidance_scale=guidance_scale, guidance_rescale=guidance_rescale,
                             frame_rate=frame_rate, decode_timestep=decode_timestep,
                             decode_noise_scale=decode_noise_scale, latents=latents, image=condition,
                             output_type=output_type, progress=progress)
