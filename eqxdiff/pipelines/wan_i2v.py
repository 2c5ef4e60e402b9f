"""Wan image-to-video (diffusers' ``WanImageToVideoPipeline`` folders): Wan 2.1 I2V with CLIP image tokens,
first-last-frame (FLF2V, ``last_image``), Wan 2.2 A14B I2V with its two experts, and TI2V-5B, whose first frame is the
image's latents with the timestep 0 on its tokens.

>>> pipe = eqxdiff.load_pipeline("Wan-AI/Wan2.1-I2V-14B-480P-Diffusers", dtype="bfloat16")
>>> video = pipe(image, "the cat turns its head", num_frames=81)              # image: uint8 [480, 832, 3]

**The image** (``image``, and ``last_image``) is one picture (uint8 ``[H, W, 3]`` or ``[1, H, W, 3]``, a PIL image,
floats in [0, 1]) for every video; its size is the video's (eqxdiff does not resize input images: ``height`` /
``width``, if given, must be its size). The condition video, the image then zero frames (then ``last_image``), is
encoded by the VAE (its posterior's mode, normalised as the latents are) and, with a mask of ``t`` channels (1 on the
given frames; ``t`` the VAE's temporal factor, 4 for Wan's: each latent frame's frames), appended to the latents'
channels: the transformer takes ``2 z + t`` channels. Wan 2.1's transformers (``image_dim``) also attend to the
image's CLIP tokens: the ``image_processor``'s pixels through ``image_encoder``, its penultimate hidden state (both
images' for FLF2V, whose transformer positions them with ``pos_embed``); or ``image_embeds`` given. Wan 2.2's (A14B,
TI2V-5B) take no CLIP tokens. The image tokens reach the transformer apart from the text, as in Wan's original code
(which cuts its 257 image tokens off the front of the context), so any ``max_sequence_length`` (or ``prompt_embeds``
length) works; diffusers' attention processor instead cuts the context at a hard-coded 512 text tokens, so there
another length mixes text tokens into the image attention (or the reverse): at 512 (the default) the two match, at
other lengths eqxdiff does not copy diffusers. diffusers repeats the CLIP tokens once per prompt, not per video, so
its Wan 2.1 image-to-video fails with ``num_videos_per_prompt > 1`` (a batch mismatch in the transformer); eqxdiff
gives every video its tokens.

**TI2V-5B** (``expand_timesteps``): the image alone is encoded; at every step the latents' first frame is replaced by
the image's latents and its tokens get the timestep 0, the others the step's; the output's first frame is the image's.
``last_image`` does not apply. diffusers builds the per-token timesteps with 2x2 spatial patches and no temporal patch
written in (``mask[:, ::2, ::2]``), so there only the released ``patch_size`` (1, 2, 2) runs; eqxdiff follows the
transformer's ``patch_size``.
"""

from collections.abc import Sequence
from typing import ClassVar

import jax.numpy as jnp
import numpy as np

from .._typing import Array, Float, PRNGKeyArray
from ..core import program
from ._arguments import resolve_key
from ._call import checked_call
from ._checks import InputError, picture_size, pixel_size
from ._components import Component
from ._images import pixel_array, to_model_range
from .wan import DEFAULT_FRAMES, MAX_SEQUENCE_LENGTH, WanPipeline, token_mask

__all__ = ["WanImageToVideoPipeline", "clip_image_embeds", "condition_latents", "frame_mask"]


@program
def clip_image_embeds(image_encoder, pixel_values: Float[Array, "n size size 3"]) -> Float[Array, "n tokens dim"]:
    """The CLIP image encoder's penultimate hidden state (``hidden_states[-2]``: no post norm), Wan 2.1's image
    tokens."""
    return image_encoder(pixel_values, output_hidden_states=True).hidden_states[-2]


@program
def condition_latents(vae, video: Float[Array, "n frames height width 3"], *,
                      tiled: bool = False) -> Float[Array, "n t h w z"]:
    """The condition videos' latents (video-to-video's start too): the posterior's mode, normalised
    (``scale_latents``) as the denoised ones;
    ``tiled`` (the pipeline's ``enable_vae_tiling()``): encoded in blended spatial tiles, as diffusers' VAE does under
    ``enable_tiling()`` (which changes the latents: each tile's mid-block attention sees that tile only)."""
    return vae.scale_latents(vae.encode(video, tiled=tiled).mode())


def frame_mask(num_frames: int, latent_shape: tuple[int, ...], factor: int, *, last: bool) -> np.ndarray:
    """diffusers' mask ``[1, T, h, w, factor]`` (channels-last) of the frames given: 1 on the first frame (repeated
    ``factor`` times, so that each latent frame has ``factor`` channels) and, with ``last``, on the last frame."""
    _, t, h, w = latent_shape[:4]
    given = np.zeros(num_frames, np.float32)
    given[0] = 1.0
    if last:
        given[-1] = 1.0
    frames = np.concatenate([np.repeat(given[:1], factor), given[1:]])  # t * factor entries
    return np.broadcast_to(frames.reshape(1, t, 1, 1, factor), (1, t, h, w, factor)).copy()


class WanImageToVideoPipeline(WanPipeline):
    """Wan image-to-video (diffusers' ``WanImageToVideoPipeline``): uint8 frames ``[n, num_frames, height, width,
    3]`` from an image and prompts; see the module docstring, and :class:`~eqxdiff.pipelines.wan.WanPipeline` for
    prompts, the two experts and the rest."""

    CLASS_NAME: ClassVar[str] = "WanImageToVideoPipeline"
    COMPONENTS: ClassVar[tuple[Component, ...]] = (
        *WanPipeline.COMPONENTS[:4],
        Component("image_processor", "transformers", "processor", optional=True),
        Component("image_encoder", "transformers", classes=("CLIPVisionModel", "CLIPVisionModelWithProjection"),
                  optional=True, encoder=True),
        *WanPipeline.COMPONENTS[4:],
    )
    INIT_IMAGE: ClassVar[str | None] = "image"
    REQUIRED_IMAGE: ClassVar[str | None] = "the first frame of the video"

    @property
    def latent_channels(self) -> int:
        """Channels of the latents the scheduler steps: the VAE's (the transformer takes more: mask and image)."""
        return self.vae.config.latent_channels

    @property
    def takes_clip_tokens(self) -> bool:
        """The transformer attends to CLIP image tokens (Wan 2.1 image-to-video: ``image_dim``)."""
        return self.transformer.config.image_dim is not None

    # -- the image ------------------------------------------------------------------------------------------------

    def check_call(self, arguments) -> None:
        """:meth:`WanPipeline.check_call`, and ``image`` / ``last_image`` each one picture (:func:`_one_picture`)
        before anything is encoded: CLIP's image processor reads them first, and its errors name neither. (Named
        explicitly, not through ``super()``: ``eqxdiff-generate`` calls it with a stand-in ``self`` before
        loading.)"""
        WanPipeline.check_call(self, arguments)
        for name in ("image", "last_image"):
            if arguments.get(name) is not None:
                _one_picture(arguments[name], name)

    def _pixels(self, image, name: str, size: tuple[int, int] | None) -> Array:
        """One picture as ``[1, H, W, 3]`` in [-1, 1], checked against the video's ``size``."""
        _one_picture(image, name)
        pixels = to_model_range(image, name)
        if size is not None and tuple(pixels.shape[1:3]) != tuple(size):
            raise InputError(f"{name} has {pixel_size(*pixels.shape[1:3])} pixels but the video has "
                             f"{pixel_size(*size)}; resize or crop it to the video's size (eqxdiff does not resize "
                             "input images), or leave height/width unset")
        return pixels

    def encode_image(self, image, last_image=None) -> Array:
        """CLIP's image tokens ``[k, tokens, dim]`` of ``image`` (and ``last_image``: ``k = 2``), through the
        folder's ``image_processor`` (resize, crop, normalise) and ``image_encoder``."""
        for name in ("image_processor", "image_encoder"):
            if getattr(self, name, None) is None:
                raise InputError(f"this pipeline's transformer takes CLIP image tokens but it has no {name}; pass "
                                 "image_embeds")
        images = [np.asarray(_picture(i)) for i in (image, last_image) if i is not None]
        pixels = self.image_processor(images=images, return_tensors="np").pixel_values
        pixels = jnp.asarray(np.transpose(pixels, (0, 2, 3, 1)), jnp.float32)  # channels-last
        return clip_image_embeds(self.encoder("image_encoder"), self.shard(pixels))

    def _image_tokens(self, image, last_image, image_embeds, videos: int):
        """CLIP's tokens for ``videos`` videos (``None`` for a transformer without ``image_dim``): the first-last
        pair's rows per video for a transformer with ``pos_embed`` (diffusers' layout), else one row of both images'
        tokens."""
        if not self.takes_clip_tokens:
            if image_embeds is not None:
                raise InputError("image_embeds: this transformer takes no CLIP image tokens (Wan 2.2); leave it out")
            return None
        embeds = self.encode_image(image, last_image) if image_embeds is None else jnp.asarray(image_embeds,
                                                                                               jnp.float32)
        dim = self.transformer.config.image_dim
        if embeds.ndim != 3 or embeds.shape[-1] != dim:
            raise InputError(f"image_embeds must be [images, tokens, {dim}] (CLIP's width, the transformer's "
                             f"image_dim), got shape {embeds.shape}")
        if self.transformer.config.pos_embed_seq_len is None and embeds.shape[0] > 1:
            embeds = embeds.reshape(1, -1, dim)  # both images' tokens in one row
        return jnp.tile(embeds, (videos, 1, 1))

    def image_condition(self, image, last_image, *, shape, num_frames: int) -> dict:
        """The image's conditioning arrays for latents of ``shape`` (:class:`~eqxdiff.pipelines.wan.WanDenoiser`):
        the mask and condition latents as extra channels, or TI2V's first frame with its masks."""
        n, t, h, w, _ = shape
        size = (h * self.vae_scale_factor, w * self.vae_scale_factor)
        first = self._pixels(image, "image", size)
        if self.expand_timesteps:
            if last_image is not None:
                raise InputError("last_image: this pipeline (expand_timesteps, TI2V-5B) conditions on the first frame "
                                 "only; leave last_image out")
            latents = jnp.repeat(condition_latents(self.vae, first[:, None], tiled=self.vae_tiling), n, axis=0)
            mask = np.ones((1, t, h, w, 1), np.float32)
            mask[:, 0] = 0.0
            tokens = token_mask(mask, self.transformer.config.patch_size)
            return {"first_frame": latents, "frame_mask": jnp.asarray(mask), "token_mask": jnp.asarray(tokens)}
        frames = [first[:, None], jnp.zeros((1, num_frames - 1 - (last_image is not None), *size, 3))]
        if last_image is not None:
            frames.append(self._pixels(last_image, "last_image", size)[:, None])
        latents = condition_latents(self.vae, jnp.concatenate(frames, axis=1), tiled=self.vae_tiling)
        mask = frame_mask(num_frames, latents.shape, self.vae_temporal_factor, last=last_image is not None)
        return {"condition": jnp.repeat(jnp.concatenate([jnp.asarray(mask), latents], axis=-1), n, axis=0)}

    def _check_channels(self) -> None:
        c, want = self.latent_channels, self.transformer.config.in_channels
        # the mask has one channel per frame of a latent frame: the VAE's temporal factor (diffusers' mask_lat_size)
        t = self.vae_temporal_factor
        expected = c if self.expand_timesteps else 2 * c + t
        if want != expected:
            parts = "" if self.expand_timesteps else f", a {t}-channel mask and the image latents"
            raise InputError(f"the transformer takes {want} input channels but image-to-video gives it {expected} "
                             f"(the VAE's {c} latents{parts}): this folder is not an image-to-video one")

    @checked_call
    def __call__(self, image=None, prompt: str | Sequence[str] | None = None, *,
                 negative_prompt: str | Sequence[str] | None = None, height: int | None = None,
                 width: int | None = None, num_frames: int = DEFAULT_FRAMES, num_inference_steps: int = 50,
                 guidance_scale: float = 5.0, guidance_scale_2: float | None = None,
                 boundary_ratio: float | None = None, num_videos_per_prompt: int = 1, seed: int | None = None,
                 key: PRNGKeyArray | None = None, latents=None, prompt_embeds=None, negative_prompt_embeds=None,
                 image_embeds=None, last_image=None, max_sequence_length: int = MAX_SEQUENCE_LENGTH,
                 output_type: str = "uint8", progress: bool = True):
        """Videos starting from ``image`` with diffusers' ``WanImageToVideoPipeline`` arguments: uint8 ``[n,
        num_frames, height, width, 3]``, or the final latents ``[n, T, h, w, C]`` with ``output_type="latent"``.

        The other arguments are :meth:`WanPipeline.__call__`'s, with the same meaning (``eqxdiff-generate --help`` reads
        them there too).

        Args:
            image: The first frame (its size is the video's).
            height: Height in pixels (default: the image's; if given, the image's).
            width: Width in pixels (default: the image's; if given, the image's).
            num_frames: Frames per video, 4k+1.
            boundary_ratio: Wan 2.2 A14B: the fraction of the training timesteps above which the high-noise expert
                runs (default: the folder's; 0.9 for image-to-video).
            image_embeds: Wan 2.1: CLIP's image tokens ``[images, tokens, image_dim]`` instead of encoding ``image``.
            last_image: The last frame (first-last-frame-to-video), the image's size.
        """
        self._check_channels()
        if last_image is not None and num_frames < 2:
            raise InputError(f"last_image is the video's last frame and image its first: num_frames={num_frames} "
                             f"gives them one frame; pass num_frames of at least {self.vae_temporal_factor + 1}, or "
                             "leave last_image out")
        key = resolve_key(seed, key)
        if not (height and width):  # the image's size fills in
            size = picture_size(image)
            height, width = height or size[0], width or size[1]
        positive, negative = self.prompts(
            num_videos_per_prompt, prompt, negative_prompt, guided=guidance_scale > 1, prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds, max_sequence_length=max_sequence_length)
        with self.timed("encode_image"):
            n = positive.shape[0]
            tokens = self._image_tokens(image, last_image, image_embeds, n)
            shape = self.video_latents_shape(n, num_frames, height, width, self.latent_channels)
            extra = self.image_condition(image, last_image, shape=shape, num_frames=num_frames)
        return self.generate(positive, negative, shape=shape, num_inference_steps=num_inference_steps,
                             guidance_scale=guidance_scale, guidance_scale_2=guidance_scale_2,
                             boundary_ratio=boundary_ratio, key=key, latents=latents, extra=extra,
                             image_embeds=tokens, output_type=output_type, progress=progress)


def _one_picture(image, name: str) -> None:
    """``image`` (argument ``name``) is one picture (:func:`~eqxdiff.pipelines._images.pixel_array`)."""
    count = len(pixel_array(image, name))
    if count != 1:
        raise InputError(f"{name} holds {count} images; pass one picture (it starts every video)")


def _picture(image):
    """``image`` as one picture the image processor reads: a PIL image, or uint8 ``[H, W, 3]`` (floats in [0, 1]
    rounded to uint8: the processor rescales by 1/255 itself)."""
    if isinstance(image, (list, tuple)):
        image = image[0]
    if hasattr(image, "convert"):  # PIL
        return image
    array = np.asarray(image)
    array = array[0] if array.ndim == 4 else array
    if array.dtype != np.uint8:
        array = (np.clip(array.astype(np.float32), 0.0, 1.0) * 255).round().astype(np.uint8)
    return array
